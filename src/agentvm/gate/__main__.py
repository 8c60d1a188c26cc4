"""``python -m agentvm.gate build|status``: the gate's compiled hot path (see ``agentvm.gate.accel``).

``build [--quiet]`` compiles the request path's modules whose current source has no build yet (about a
minute on 2 cores for all of them; scripts/install.sh runs it) and exits 1 if any failed;
``status`` prints, per module, whether a new process would run it compiled, and why not.
"""

import sys

from agentvm.gate import accel


def main(argv: list[str]) -> int:
    if argv[:1] == ["build"]:
        quiet = "--quiet" in argv[1:]
        todo = accel.unbuilt()
        if todo:
            print(f"agentvm.gate build: compiling {len(todo)} module(s) of the gate's request path with Cython "
                  f"(about {5 * len(todo)} s on 2 cores)", file=sys.stderr)
        errors = accel.build()
        for e in errors:
            print(f"agentvm.gate build: {e}", file=sys.stderr)
        if not quiet or errors:
            print(f"gate hot path: {accel.summary()[1]}", file=sys.stderr if errors else sys.stdout)
        return 1 if errors else 0
    if argv[:1] == ["status"]:
        for mod, why in accel.status().items():
            print(f"{mod:12} {why}")
        return 0
    print("usage: python -m agentvm.gate build|status", file=sys.stderr)
    return 2


sys.exit(main(sys.argv[1:]))
