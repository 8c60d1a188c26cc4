// agent-vm console: the live decision stream (server-sent events). Rows are built with
// textContent only: a host, path or reason from a sandbox is data, never markup.
"use strict";

function fmtTime(t) {
  const d = new Date(t * 1000);
  const p = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
}

function fmtSize(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
}

function cell(tr, text, cls) {
  const td = document.createElement("td");
  if (cls) td.className = cls;
  td.textContent = text === null || text === undefined ? "" : String(text);
  tr.appendChild(td);
  return td;
}

function addRow(tbody, r) {
  const tr = document.createElement("tr");
  tr.className = `v-${r.verdict} fresh`;
  cell(tr, fmtTime(r.time));
  cell(tr, r.agent);
  cell(tr, r.verdict);
  cell(tr, r.method || "");
  cell(tr, r.host + (r.port && r.port !== 80 && r.port !== 443 ? `:${r.port}` : ""));
  cell(tr, r.path || (r.tool ? `tool ${r.tool}` : ""), "path");
  const rule = cell(tr, "");
  const code = document.createElement("code");
  code.textContent = r.rule || "";
  rule.appendChild(code);
  cell(tr, r.reason, "reason");
  cell(tr, fmtSize(r.bytes_out));
  cell(tr, fmtSize(r.bytes_in));
  tbody.insertBefore(tr, tbody.firstChild);
  while (tbody.rows.length > 500) tbody.deleteRow(tbody.rows.length - 1);
}

document.addEventListener("DOMContentLoaded", () => {
  const live = document.getElementById("live");
  const table = document.getElementById("decisions");
  if (!live || !table || !window.EventSource) return;
  const tbody = table.tBodies[0];
  const es = new EventSource(live.dataset.stream);
  live.hidden = false;
  es.onopen = () => { live.classList.remove("down"); live.textContent = "live"; };
  es.onerror = () => { live.classList.add("down"); live.textContent = "reconnecting"; };
  // the daemon cut this stream off because it fell behind: reload, so nothing shown is stale
  es.addEventListener("lagged", () => { es.close(); window.location.reload(); });
  es.onmessage = (ev) => {
    let r;
    try { r = JSON.parse(ev.data); } catch (e) { return; }
    const empty = document.getElementById("empty");
    if (empty) empty.remove();
    addRow(tbody, r);
  };
});
