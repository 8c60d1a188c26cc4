# More of e2b-code-interpreter (its documented calls), unchanged: streaming callbacks, errors,
# display data, env vars, contexts.
from e2b_code_interpreter import Sandbox

with Sandbox.create() as sandbox:
    execution = sandbox.run_code(
        "import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\n6 * 7",
        on_stdout=lambda m: print("on_stdout:", m.line.strip()),
        on_stderr=lambda m: print("on_stderr:", m.line.strip()),
    )
    print("text:", execution.text)
    print("logs:", execution.logs.stdout, execution.logs.stderr)

    execution = sandbox.run_code("1 / 0")
    print("error:", execution.error.name, execution.error.value)

    execution = sandbox.run_code("from IPython.display import HTML, display\ndisplay(HTML('<b>hi</b>'))")
    print("html:", execution.results[0].html)

    execution = sandbox.run_code("import os; os.environ.get('GREETING')", envs={"GREETING": "hello"})
    print("env:", execution.text)
    print("env after:", sandbox.run_code("import os; os.environ.get('GREETING')").text)

    context = sandbox.create_code_context()
    sandbox.run_code("y = 'in the context'", context=context)
    print("context:", sandbox.run_code("y", context=context).text)
    print("default has no y:", sandbox.run_code("'y' in dir()").text)
    print("contexts:", len(sandbox.list_code_contexts()))
    sandbox.remove_code_context(context)
