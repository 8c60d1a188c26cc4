"""A Jupyter kernel inside the sandbox, driven with jupyter_client as code-interpreter agents
drive it: ZeroMQ over the sandbox's own loopback TCP, execute, read output, interrupt a
running cell, restart. (Debian's python3-ipykernel and python3-jupyter-client.)"""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import needs_root

pytestmark = [pytest.mark.integration, needs_root]

DRIVER = textwrap.dedent("""
    import time
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=60)
    try:
        def run(code, timeout=30):
            out = []
            reply = kc.execute_interactive(code, timeout=timeout,
                                           output_hook=lambda m: out.append(m["content"].get("text", "")))
            return reply["content"]["status"], "".join(out)

        print("EXEC", *run("import os; print(6 * 7, os.getuid())"))
        print("STATE", *run("x = 41"), *run("print(x + 1)"))
        # interrupt a long cell (SIGINT to the kernel) and check the kernel survives
        msg_id = kc.execute("import time; time.sleep(60)")
        time.sleep(1.0)
        km.interrupt_kernel()
        t0 = time.monotonic()
        while True:
            m = kc.get_iopub_msg(timeout=20)
            if m["msg_type"] == "error":
                print("INTERRUPTED", m["content"]["ename"], round(time.monotonic() - t0, 1) < 15)
                break
        kc.get_shell_msg(timeout=20)
        time.sleep(1.0)  # ipykernel aborts requests that arrive right after an error (stop_on_error)
        print("AFTER", *run("print('alive')"))
        km.restart_kernel(now=True)
        kc.wait_for_ready(timeout=60)
        status, text = run("print('x' in dir())")
        print("RESTARTED", status, text.strip())
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    print("JUPYTER DONE")
""")


def test_a_jupyter_kernel_executes_interrupts_and_restarts(py):
    r = py(DRIVER, "--memory", "1G", "--timeout", "3m", timeout=240)
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-3000:]
    assert "EXEC ok 42 1000" in out, out
    assert "STATE ok  ok 42" in out, out
    assert "INTERRUPTED KeyboardInterrupt True" in out, out
    assert "AFTER ok alive" in out, out
    assert "RESTARTED ok False" in out, out  # a fresh kernel: the old variable is gone
    assert "JUPYTER DONE" in out
