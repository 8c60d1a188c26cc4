"""``agentvm run``: one command in an ephemeral sandbox (or in a declared agent's sandbox).

Contract (stable; see docs/cli.md)::

    agentvm run [-f AGENT.yaml] [--mount HOST:PATH[:ro|rw]]... [--timeout DURATION]
                [--memory SIZE] [--env K=V]... [--json] [--tty | --no-tty]
                [--degrade PRIMITIVE]... [--raw-output] [--] CMD [ARGS...]

Exit code: the command's own; 124 on timeout; 77 when refused (policy, missing primitive);
78 for an invalid agent file or option; 125 when agent-vm or the substrate failed; 127 when
CMD is not found, 126 when it cannot be executed; 128+N when it died of signal N.

This is the hot path, so it is parsed with argparse and imports neither click nor pydantic
(unless ``-f`` is given); the plain form ``run -- CMD...`` does not even import argparse. The click app registers a pass-through ``run`` so it is listed in
``agentvm --help``; argparse stays the only parser.
"""

from __future__ import annotations

import json
import sys

from agentvm.errors import EXIT_CONFIG, AgentVMError, ConfigError

PRIMITIVE_HELP = (
    "bwrap: userns, bwrap, seccomp, landlock, landlock-net, landlock-scope, cgroups, cgroup-kill, dedicated-uid, "
    "disk-quota; gvisor: see `agentvm doctor --substrate gvisor`"
)


def build_parser():
    """The argparse parser of ``agentvm run`` (argparse imported here: not on the plain form's path)."""
    import argparse

    class _Parser(argparse.ArgumentParser):
        def error(self, message: str):  # usage errors are config errors (exit 78), not argparse's 2
            raise ConfigError(f"agentvm run: {message}", hint="see `agentvm run --help`")

    p = _Parser(
        prog="agentvm run",
        description="Run CMD in a fresh sandbox and propagate its exit code.",
        epilog="Exit codes: CMD's own; 124 timeout; 77 refused (policy or missing primitive); 78 invalid input; "
        "125 agent-vm/substrate failure; 126/127 CMD not executable/not found; 128+N killed by signal N.",
    )
    p.add_argument("-f", "--file", dest="agent_file", metavar="AGENT.yaml", help="agent file (YAML)")
    p.add_argument("--mount", action="append", default=[], metavar="HOST:PATH[:ro|rw]", help="grant a host folder")
    p.add_argument("--timeout", metavar="DURATION", help="wall-clock timeout, e.g. 30s, 5m")
    p.add_argument("--memory", metavar="SIZE", help="memory limit, e.g. 256M, 2G")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="set a variable in the sandbox")
    p.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="HOST[:PORT]",
        help="ad-hoc egress rule through the gate (ports 80 and 443 when none is given); needs tier >= L2",
    )
    p.add_argument(
        "--add-host", action="append", default=[], metavar="NAME=IP", help="static name -> address for the gate (no DNS)"
    )
    p.add_argument(
        "--substrate",
        choices=("bwrap", "gvisor"),
        help="the sandbox technology (default: the agent file's, else bwrap); the agent's minSubstrate still holds",
    )
    p.add_argument(
        "--image",
        metavar="REF",
        help="run on this image (a name of `agentvm image ls`, or sha256:...) instead of the host's /usr",
    )
    p.add_argument(
        "--network",
        choices=("gate", "none"),
        help="gate (default): every request goes through the egress gate, which denies what no rule allows, "
        "explained and logged; none: no route out at all",
    )
    p.add_argument("--json", dest="as_json", action="store_true", help="print a JSON result as the last stdout line")
    tty = p.add_mutually_exclusive_group()
    tty.add_argument("--tty", dest="tty", action="store_true", default=None, help="give the sandbox a terminal")
    tty.add_argument("--no-tty", dest="tty", action="store_false", help="never give the sandbox a terminal")
    p.add_argument(
        "--raw-output",
        action="store_true",
        help="write the sandbox's output to this terminal byte for byte (default: on a terminal, escape sequences "
        "that make it act - clipboard, answer-back queries, titles - are removed; AGENTVM_RAW_OUTPUT=1 is the same)",
    )
    p.add_argument(
        "--degrade",
        action="append",
        default=[],
        metavar="PRIMITIVE",
        help=f"run without a missing primitive ({PRIMITIVE_HELP}); printed and recorded, never silent",
    )
    p.add_argument("--preset-path", action="append", default=[], metavar="DIR", help="extra preset directory")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command (after --)")
    return p


def main_run(argv: list[str]) -> int:
    as_json = "--json" in argv
    try:
        return _run(argv)
    except AgentVMError as err:
        from agentvm.cli.report import report_error

        return report_error(err, as_json=as_json)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a full state disk is one clear error (exit 75), not a traceback
        from agentvm.errors import disk_full_error

        from agentvm.paths import default_paths

        full = disk_full_error(exc, where=default_paths().home)
        if full is None:
            raise
        from agentvm.cli.report import report_error

        return report_error(full, as_json=as_json)


def _plain(argv: list[str]):
    """``run -- CMD...`` (no option at all) as the parser would read it, without argparse (its
    import and the parser's construction are a few ms of every start); None for anything else."""
    if not argv or argv[0] != "--":
        return None
    from types import SimpleNamespace

    return SimpleNamespace(agent_file=None, mount=[], timeout=None, memory=None, env=[], allow=[], add_host=[],
                           substrate=None, image=None, network=None, as_json=False, tty=None, raw_output=False,
                           degrade=[], preset_path=[], command=list(argv))


def _run(argv: list[str]) -> int:
    ns = _plain(argv) or build_parser().parse_args(argv)
    command = list(ns.command)
    if command and command[0] == "--":
        command = command[1:]
    if not ns.agent_file and not command:
        raise ConfigError("nothing to run", hint="agentvm run -- CMD [ARGS...], or agentvm run -f AGENT.yaml")
    raw = {"mounts": ns.mount, "env": ns.env, "timeout": ns.timeout, "memory": ns.memory, "allow": ns.allow,
           "add_host": ns.add_host, "network": ns.network, "substrate": ns.substrate, "image": ns.image}
    degrade = tuple(dict.fromkeys(ns.degrade))
    if degrade:
        print(
            "\033[1;31magentvm: WARNING: running DEGRADED without: " + ", ".join(degrade)
            + " (recorded in the audit log)\033[0m" if sys.stderr.isatty() else
            "agentvm: WARNING: running DEGRADED without: " + ", ".join(degrade) + " (recorded in the audit log)",
            file=sys.stderr,
        )
    # a daemon that is up does everything else: the thin client parses nothing more
    via = _daemon_for(ns, degrade)
    if via is not None:
        code = _run_via_daemon(via, ns, command, raw)
        if code is not None:
            return code
        # a daemon without interactive sessions (404, nothing ran): embedded, as before

    from agentvm.overrides import from_cli
    from agentvm.policy import Policy, with_overrides

    from agentvm.errors import HostEnvironmentError, PolicyDenied

    name = "run"
    try:
        if ns.agent_file:
            from pathlib import Path

            from agentvm.policy import compile_policy
            from agentvm.spec.loader import load_agent

            loaded = load_agent(Path(ns.agent_file), preset_dirs=[Path(p) for p in ns.preset_path] or None)
            name = loaded.spec.metadata.name
            policy = compile_policy(loaded.spec)
        else:
            policy = Policy(name="run", network=ns.network or "gate")  # "none": no gate rules to compile at all
        policy = with_overrides(policy, **from_cli(raw, command))
    except (PolicyDenied, HostEnvironmentError) as exc:
        # refused before the lifecycle's own preflight (a tier ceiling, an option): on the chain
        # all the same, as every refused run is
        from agentvm.runtime import Runtime

        rt = Runtime()
        try:
            rt.record("run.refused", agent=name, code=exc.code, message=exc.message[:500])
        finally:
            rt.close()
        raise
    if not policy.command:
        raise ConfigError("the agent file declares no command and none was given after --")

    from agentvm.runtime import Runtime

    rt = Runtime()
    # decided before the output filter puts pipes on stdout/stderr, as Runtime.run would decide it
    tty = ns.tty if ns.tty is not None else (sys.stdin.isatty() and sys.stdout.isatty())
    try:
        with _output_filter(ns.raw_output):
            result = rt.run(policy, degrade=degrade, tty=tty)
    finally:
        rt.close()
    _report(result.to_dict(), ns.as_json)
    return result.exit_code


def _output_filter(raw: bool):
    """An embedded run's sandbox writes to this process's stdout/stderr: where one is a
    terminal, through agentvm.termfilter (docs/daemon.md "What reaches the terminal")."""
    import os

    if raw or os.environ.get("AGENTVM_RAW_OUTPUT") == "1" or not (os.isatty(1) or os.isatty(2)):
        from contextlib import nullcontext

        return nullcontext()
    from agentvm.termfilter import filtered_fds

    return filtered_fds()


def _daemon_for(ns, degrade):
    """Use the daemon when one is up - unless a primitive is degraded (that is the embedded
    run's, printed on this terminal). A terminal and a stdin pipe are relayed (an interactive
    session: docs/daemon.md)."""
    import os

    from agentvm.cli.fastrun import connect

    if os.environ.get("AGENTVM_NO_DAEMON") == "1" or degrade:
        return None
    return connect()  # None: no daemon listening - the run is embedded


def _run_via_daemon(sock, ns, command: list[str], raw: dict) -> int:
    """The same run, by the daemon: it gets the agent file's text and the options exactly as
    typed; it parses them with the same code (``agentvm.overrides``) and runs the same
    lifecycle on its own gate."""
    import os

    doc: dict = {"command": command or None, "cli": raw}
    if ns.agent_file:
        from pathlib import Path

        from agentvm.paths import default_preset_dirs

        doc["spec"] = Path(ns.agent_file).read_text()
        doc["file"] = str(Path(ns.agent_file).resolve())

        # the caller's preset search path (--preset-path, else its own default), not the daemon's
        doc["preset_dirs"] = [str(p) for p in ns.preset_path] or [str(d) for d in default_preset_dirs()]
    from agentvm.cli.fastrun import stdin_kind

    tty = ns.tty if ns.tty is not None else (sys.stdin.isatty() and sys.stdout.isatty())
    if tty or stdin_kind() != "none":
        # stdin to relay (a pipe, a file, a terminal) or a terminal to give: an interactive
        # session, streamed both ways (nothing buffered whole)
        from agentvm.cli.fastrun import ATTACH_PATH, attach, attach_body

        if ns.as_json:
            doc["report"] = "json"
        try:
            code = attach(sock, ATTACH_PATH, attach_body(json.dumps(doc).encode(), tty), tty=tty,
                          report_to_stdout=ns.as_json, raw_output=ns.raw_output)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
        except (ConnectionError, OSError, ValueError) as exc:
            print(f"agentvm: the daemon ended the run without a result ({exc})", file=sys.stderr)
            return 125
        return code
    result = None
    from agentvm.cli.fastrun import output_filters, run_stream

    fo, fe = output_filters(ns.raw_output)
    try:
        for ev in run_stream(sock, doc):
            if ev.get("stream") == "stdout":
                sys.stdout.buffer.write(fo.feed(ev["data"]) if fo else ev["data"])
                sys.stdout.buffer.flush()
            elif ev.get("stream") == "stderr":
                sys.stderr.buffer.write(fe.feed(ev["data"]) if fe else ev["data"])
                sys.stderr.buffer.flush()
            elif "result" in ev:
                result = ev["result"]
    except BrokenPipeError:
        # our reader went away (`| head`): dropping the connection makes the daemon stop the run
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        return 130
    for f in (fo, fe):
        if f is not None:
            f.finish()  # what the sandbox left incomplete is dropped
    if result is None:
        print("agentvm: the daemon ended the run without a result", file=sys.stderr)
        return 125
    _report(result, ns.as_json)
    return int(result["exit_code"])


def _report(result: dict, as_json: bool) -> None:
    """The run's result: as JSON (the last stdout line) or as the stderr report."""
    if as_json:
        sys.stdout.flush()
        print(json.dumps(result, sort_keys=True), flush=True)
        return
    from agentvm.runreport import render

    sys.stderr.write(render(result))


def _click_command():
    import click

    @click.command(
        name="run",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
        add_help_option=False,
    )
    @click.pass_context
    def run_click(ctx):
        """Run CMD in a fresh sandbox (see `agentvm run --help`)."""
        return main_run(list(ctx.args))

    return run_click


def __getattr__(name: str):
    if name == "run_click":
        return _click_command()
    raise AttributeError(name)


__all__ = ["main_run", "build_parser", "EXIT_CONFIG"]
