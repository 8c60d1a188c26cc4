# E2B Code Interpreter's README example (github.com/e2b-dev/code-interpreter), unchanged.
# On agent-vm: build examples/images/code-interpreter/image.yaml and register its template.yaml
# as `code-interpreter-v1` with --port 49999 (docs/e2b.md, "Code interpreter").
from e2b_code_interpreter import Sandbox

with Sandbox.create() as sandbox:
    sandbox.run_code("x = 1")
    execution = sandbox.run_code("x+=1; x")
    print(execution.text)  # outputs 2
