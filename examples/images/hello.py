"""Runs twice: at build time (`--build`, a `run` command of hello-image.yaml, inside the tree
being built, no network) and as the agent of agent.yaml (in a sandbox whose root is the image)."""

import os
import platform
import sys


def distro() -> str:
    with open("/etc/os-release") as f:
        fields = dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
    return fields.get("PRETTY_NAME", "?").strip('"')


if "--build" in sys.argv:
    print(f"hello-image: built with Python {platform.python_version()} on {distro()}")
    sys.exit(0)

print(f"hello from the image: Python {platform.python_version()} ({sys.executable}) on {distro()}")
with open("/usr/share/hello-image.txt") as f:
    print("recorded at build time:", f.read().strip())
# the image holds only what its file asked for: none of the host's /usr is here
for tool in ("gcc", "mmdebstrap", "curl"):
    found = any(os.path.exists(os.path.join(d, tool)) for d in ("/usr/bin", "/usr/sbin", "/usr/local/bin"))
    print(f"  {tool}: {'present' if found else 'not in this image'}")
print("uid", os.getuid(), "- workspace", os.getcwd())
