// Preloaded in agent-vm sandboxes (NODE_OPTIONS=--require ...) when egress goes through the
// gate. Node's built-in fetch ignores HTTP(S)_PROXY before Node 24 (NODE_USE_ENV_PROXY), so
// route it through the gate with undici's EnvHttpProxyAgent - the same dispatcher Node's fetch
// uses internally. Without undici, fetch simply has no route out (fail closed).
'use strict';
try {
  const undici = require(__dirname + '/node_modules/undici');
  if (typeof undici.EnvHttpProxyAgent === 'function') {
    // undici flags EnvHttpProxyAgent "experimental" on stderr: not the agent's business
    const emit = process.emitWarning;
    process.emitWarning = function (w, ...rest) {
      if (String(w && w.message || w).includes('EnvHttpProxyAgent')) return;
      return emit.call(process, w, ...rest);
    };
    try {
      undici.setGlobalDispatcher(new undici.EnvHttpProxyAgent());
    } finally {
      process.emitWarning = emit;
    }
  }
} catch (e) {
  // no shim: nothing to do
}
