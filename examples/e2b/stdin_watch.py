# E2B's examples for stdin (e2b.dev/docs/commands) and directory watches
# (e2b.dev/docs/filesystem/watch), unchanged except for the watched path (the workspace).
from e2b import Sandbox

sandbox = Sandbox.create()

cmd = sandbox.commands.run('cat', background=True, stdin=True)
sandbox.commands.send_stdin(cmd.pid, 'hello from stdin\n')
sandbox.commands.close_stdin(cmd.pid)
print("stdin:", repr(cmd.wait().stdout))

dirname = '/workspace'
handle = sandbox.files.watch_dir(dirname)
sandbox.files.write(f"{dirname}/my-file", "hello")
events = handle.get_new_events()
print("events:", sorted({(e.type.name, e.name) for e in events}))
handle.stop()

sandbox.kill()
