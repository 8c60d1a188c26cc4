# E2B's quickstart (e2b.dev/docs/quickstart), unchanged: only the environment printed by
# `agentvm e2b env` points it at agent-vm.
from e2b import Sandbox

sbx = Sandbox.create()  # By default the sandbox is alive for 5 minutes
execution = sbx.commands.run("echo 'Hello, World!'")
print(execution.stdout)

files = sbx.files.list("/")
print(files)

sbx.kill()
