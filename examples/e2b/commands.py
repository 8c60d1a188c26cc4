# E2B's "Running commands" examples (e2b.dev/docs/commands), unchanged.
from e2b import Sandbox

sandbox = Sandbox.create()

# foreground, with streaming callbacks
result = sandbox.commands.run('echo hello; sleep 1; echo world',
                              on_stdout=lambda data: print("stdout:", data),
                              on_stderr=lambda data: print("stderr:", data))
print("exit:", result.exit_code, repr(result.stdout))

# in the background, then wait
command = sandbox.commands.run('echo hello; sleep 1; echo world', background=True)
result = command.wait()
print("background:", repr(result.stdout))

# in the background, then kill
command = sandbox.commands.run('echo started; sleep 100; echo never', background=True,
                               on_stdout=lambda data: print("bg:", data))
print("killed:", command.kill())

# environment variables and working directory
result = sandbox.commands.run('echo $MY_VAR; pwd', envs={'MY_VAR': '123'}, cwd='/tmp')
print("envs:", result.stdout.split())

sandbox.kill()
