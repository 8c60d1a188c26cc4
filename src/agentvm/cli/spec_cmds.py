"""``agentvm validate | compile | presets | schema``: the agent-file commands.

Thin wrappers over :mod:`agentvm.spec.loader` and :mod:`agentvm.spec.schema`. Problems are
printed as ``file:line: field: message``; invalid input exits with 78 (EX_CONFIG).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from agentvm.errors import EXIT_CONFIG, EXIT_OK, AgentVMError, SpecError

_preset_path_option = click.option(
    "--preset-path",
    "preset_path",
    multiple=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="A directory of user presets, searched before $AGENTVM_PRESET_PATH, "
    "$AGENTVM_HOME/presets and the built-in presets (repeatable).",
)


def _dirs(preset_path: tuple[Path, ...]) -> list[Path]:
    from agentvm.spec.loader import default_preset_dirs

    return list(preset_path) + default_preset_dirs()


def _fail(err: AgentVMError, as_json: bool = False) -> None:
    """Report an error the way ``agentvm.cli.report_error`` does and exit with its code."""
    if as_json:
        click.echo(json.dumps(err.to_dict(), indent=2))
    elif isinstance(err, SpecError) and err.problems:
        for p in err.problems:
            click.echo(p.render(), err=True)
        if err.hint:
            click.echo(f"  hint: {err.hint}", err=True)
    else:
        click.echo(f"agentvm: error [{err.code}]: {err.message}", err=True)
        if err.hint:
            click.echo(f"  hint: {err.hint}", err=True)
    raise click.exceptions.Exit(err.exit_code)


@click.command("validate")
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--strict", is_flag=True, help="Treat conflicts between presets as errors.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of per-file results.")
@_preset_path_option
def validate(files: tuple[Path, ...], strict: bool, as_json: bool, preset_path: tuple[Path, ...]) -> None:
    """Check agent, preset and image files (detected by their `kind`).

    Prints FILE: ok, or every problem as file:line: field: message. Conflicts between
    presets are warnings (errors with --strict). Exit 0 when every file is valid, else 78.
    """
    from agentvm.spec.loader import validate_file

    dirs = _dirs(preset_path)
    reports = [_validate_image(f) if _kind(f) == "Image" else validate_file(f, preset_dirs=dirs, strict=strict)
               for f in files]
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        for r in reports:
            for c in r.conflicts:
                if strict and c.kind == "conflict":
                    continue  # already a problem
                label = "warning" if c.kind == "conflict" else "note"
                click.echo(f"{r.file}: {label}: {c.render()}", err=True)
            if r.ok:
                click.echo(f"{r.file}: ok")
            else:
                for p in r.problems:
                    click.echo(p.render())
    code = EXIT_OK if all(r.ok for r in reports) else EXIT_CONFIG
    raise click.exceptions.Exit(code)


def _kind(path: Path) -> str | None:
    """The ``kind`` a file declares, if it is readable YAML (else the agent loader reports it)."""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return doc.get("kind") if isinstance(doc, dict) else None


def _validate_image(path: Path):
    """An image file (`agentvm image build`'s) checked as a build would check it before starting."""
    from agentvm.errors import ConfigError, SpecProblem
    from agentvm.images.build import check
    from agentvm.spec.loader import FileReport

    try:
        check(path)
    except ConfigError as exc:
        message = exc.message.removeprefix(f"{path}: ")
        return FileReport(str(path), "Image", [SpecProblem(str(path), None, "", message)], [], [])
    return FileReport(str(path), "Image", [], [], [])


@click.command("compile")
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of YAML.")
@click.option("--plan", "show_plan", is_flag=True,
              help="Print the substrate's launch plan instead (common header + the substrate's own body).")
@click.option("--substrate", type=click.Choice(["bwrap", "gvisor"]), default=None,
              help="With --plan: the substrate to plan for (default: the agent file's).")
@_preset_path_option
def compile_cmd(file: Path, as_json: bool, show_plan: bool, substrate: str | None, preset_path: tuple[Path, ...]) -> None:
    """Print the fully resolved agent spec (presets merged, defaults filled in), or with
    --plan what a substrate would launch for it.

    The merge order and every conflict/override go to stderr; the spec to stdout.
    """
    from agentvm.spec.loader import dump_resolved, load_agent

    try:
        loaded = load_agent(file, preset_dirs=_dirs(preset_path))
        if show_plan:
            from agentvm.policy import compile_policy, with_overrides
            from agentvm.runtime import Runtime

            policy = with_overrides(compile_policy(loaded.spec), substrate=substrate)
            rt = Runtime()
            try:
                plan = rt.preview(policy)
            finally:
                rt.close()
    except AgentVMError as err:
        _fail(err, as_json)
        return
    if show_plan:
        d = plan.to_dict()
        click.echo(json.dumps(d, indent=2) if as_json else _to_yaml(d), nl=as_json)
        return
    order = " -> ".join(loaded.presets + [f"{loaded.source} (agent)"])
    click.echo(f"# merge order: {order}", err=True)
    for c in loaded.conflicts:
        click.echo(f"# {c.render()}", err=True)
    data = dump_resolved(loaded)
    if as_json:
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(_to_yaml(data), nl=False)


def _to_yaml(data: dict) -> str:
    import yaml

    class _Dumper(yaml.SafeDumper):
        pass

    def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None  # PyYAML falls back to quoting when "|" cannot hold it
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    _Dumper.add_representer(str, _str)
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True)


@click.command("presets")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_preset_path_option
def presets(as_json: bool, preset_path: tuple[Path, ...]) -> None:
    """List the presets an agent can use: name, origin and description."""
    from agentvm.spec.loader import list_presets

    infos = list_presets(_dirs(preset_path))
    if as_json:
        click.echo(json.dumps([i.to_dict() for i in infos], indent=2))
        return
    rows = []
    for i in infos:
        origin = "builtin" if i.builtin else f"user {i.file}"
        if i.shadows_builtin:
            origin += " (shadows builtin)"
        desc = f"INVALID: {i.error}" if i.error else i.description
        rows.append((i.name, origin, desc))
    w0 = max([len("NAME")] + [len(r[0]) for r in rows])
    w1 = max([len("ORIGIN")] + [len(r[1]) for r in rows])
    click.echo(f"{'NAME':<{w0}}  {'ORIGIN':<{w1}}  DESCRIPTION")
    for name, origin, desc in rows:
        click.echo(f"{name:<{w0}}  {origin:<{w1}}  {desc}")


@click.command("schema")
def schema() -> None:
    """Print the JSON Schema of agent files (for editors)."""
    from agentvm.spec.schema import render

    click.echo(render(), nl=False)
