"""The agent's side: the official mcp SDK client inside the sandbox, against the tool gateway
at $AGENTVM_MCP_URL. argv[1]: JSON list of operations; argv[2]: the client's connect mode
("auto": the 2026-07-28 revision when the server speaks it; "legacy": the initialize handshake
of the revisions clients speak today); argv[3] "stdio": through the agentvm-mcp shim (a
command on PATH) instead of HTTP. One JSON line per operation."""

import asyncio
import json
import os
import sys

sys.path.insert(0, "/opt/testlib")
from mcp import Client  # noqa: E402


async def main() -> None:
    ops = json.loads(sys.argv[1])
    mode = sys.argv[2] if len(sys.argv) > 2 else "auto"
    target = os.environ["AGENTVM_MCP_URL"]
    if len(sys.argv) > 3 and sys.argv[3] == "stdio":
        from mcp.client.stdio import StdioServerParameters

        target = StdioServerParameters(command="agentvm-mcp", env=dict(os.environ))
    async with Client(target, mode=mode) as c:
        print(json.dumps({"protocol": c.protocol_version}), flush=True)
        for op in ops:
            try:
                if op[0] == "list":
                    r = await c.list_tools()
                    out = {"tools": sorted(t.name for t in r.tools)}
                elif op[0] == "call":
                    r = await c.call_tool(op[1], op[2])
                    out = {"ok": not r.is_error, "text": "".join(getattr(x, "text", "") for x in r.content)}
                elif op[0] == "resources":
                    out = {"resources": sorted(str(r.uri) for r in (await c.list_resources()).resources)}
                elif op[0] == "read":
                    r = await c.read_resource(op[1])
                    out = {"text": "".join(getattr(x, "text", "") for x in r.contents)}
                elif op[0] == "prompts":
                    out = {"prompts": sorted(p.name for p in (await c.list_prompts()).prompts)}
                elif op[0] == "prompt":
                    r = await c.get_prompt(op[1], op[2])
                    out = {"text": "".join(getattr(m.content, "text", "") for m in r.messages)}
                else:
                    out = {"bad-op": op[0]}
            except Exception as exc:  # noqa: BLE001
                out = {"error": str(exc), "type": type(exc).__name__}
            print(json.dumps(out), flush=True)


asyncio.run(main())
