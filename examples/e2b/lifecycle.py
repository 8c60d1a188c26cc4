# E2B's "Sandbox lifecycle" examples (e2b.dev/docs/sandbox), unchanged.
from e2b import Sandbox

# Create sandbox with and keep it running for 60 seconds.
sandbox = Sandbox.create(timeout=60, metadata={"userId": "123"})
# Change the sandbox timeout to 30 seconds.
sandbox.set_timeout(30)

info = sandbox.get_info()
print("info:", info.sandbox_id == sandbox.sandbox_id, info.metadata, info.template_id)

paginator = Sandbox.list()
running = paginator.next_items()
print("listed:", [s.sandbox_id for s in running].count(sandbox.sandbox_id))

same = Sandbox.connect(sandbox.sandbox_id)
print("connected:", same.commands.run("echo again").stdout.strip())

sandbox.kill()
print("running after kill:", sandbox.is_running())
