# E2B's "Read & write files" examples (e2b.dev/docs/filesystem), unchanged except that the
# docs' placeholder path '/path/to/file' is a path the sandbox may write: an agent-vm sandbox's
# root is read-only; its workspace (the default directory) and /tmp are writable.
from e2b import Sandbox

sandbox = Sandbox.create()

sandbox.files.write('/tmp/path/to/file', 'file content')
file_content = sandbox.files.read('/tmp/path/to/file')
print("read:", file_content)

sandbox.files.write('notes.txt', 'in the workspace')  # relative: the sandbox's home directory
print("relative:", sandbox.files.read('notes.txt'))

# write multiple files
sandbox.files.write_files([
    {"path": "/tmp/multi/a.txt", "data": "A"},
    {"path": "/tmp/multi/b.txt", "data": "B"},
])
files = sandbox.files.list('/tmp/multi')
print("list:", sorted(f.name for f in files))

print("exists:", sandbox.files.exists('/tmp/multi/a.txt'), sandbox.files.exists('/tmp/nope'))
print("make_dir:", sandbox.files.make_dir('/tmp/newdir'))
sandbox.files.rename('/tmp/multi/a.txt', '/tmp/newdir/a.txt')
print("info:", sandbox.files.get_info('/tmp/newdir/a.txt').size)
sandbox.files.remove('/tmp/newdir')
print("removed:", not sandbox.files.exists('/tmp/newdir'))

sandbox.kill()
