"""`agentvm image build | import | ls | inspect | rm | gc | verify | sign` (docs/images.md).

Images live under agent-vm's home (``<home>/images``); these commands work on it directly
(as the daemon's user: root), not through the daemon."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click


def _store():
    from agentvm.images import Store
    from agentvm.paths import default_paths

    return Store(default_paths().home)


def _say(msg: str) -> None:
    click.echo(f"agentvm image: {msg}", err=True)


@click.group()
def image():
    """Agent images: read-only roots, content-addressed, signed."""


@image.command("build")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def build_cmd(file, as_json):
    """Build the image FILE describes (Debian packages with mmdebstrap, files, commands)."""
    from agentvm import native
    from agentvm.images.build import build
    from agentvm.paths import default_paths

    t0 = time.monotonic()
    bwrap = str(native.bwrap_path(default_paths().libexec))
    img, stats = build(_store(), file, progress=_say, bwrap=bwrap)
    if stats.setuid_removed:
        _say(f"setuid/setgid bits removed from {len(stats.setuid_removed)} files "
             f"({', '.join(stats.setuid_removed[:5])}{'...' if len(stats.setuid_removed) > 5 else ''})")
    _done(img, time.monotonic() - t0, as_json)


@image.command("import")
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option("--name", required=True, help="the local name to give it")
@click.option("--ref", help="which image of a layout or archive holding several (ref name or tag)")
@click.option("--allow-setuid", is_flag=True, help="keep setuid/setgid bits (removed by default)")
@click.option("--max-size", default="16G", show_default=True, help="refuse an image larger than this, unpacked")
@click.option("--json", "as_json", is_flag=True)
def import_cmd(source, name, ref, allow_setuid, max_size, as_json):
    """Import an OCI image layout (a directory or its tar) or a `docker save` tarball."""
    import shutil

    from agentvm.images import check_name
    from agentvm.images.layers import Limits, import_layers
    from agentvm.units import parse_size

    check_name(name)
    t0 = time.monotonic()
    store = _store()
    staging = store.staging()
    root = staging / "root"
    root.mkdir(mode=0o755)
    try:
        lim = Limits(max_total=parse_size(max_size), allow_setuid=allow_setuid)
        stats, desc = import_layers(source, root, lim, ref=ref, progress=_say)
        _say("hashing the tree")
        img = store.commit(root, {"source": "import", "from": str(Path(source).resolve()), **desc,
                                  "setuid_removed": stats.setuid_removed[:100], "whiteouts": stats.whiteouts}, name,
                           allow_setuid=allow_setuid)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # nothing half-written is left
    if stats.setuid_removed:
        _say(f"setuid/setgid bits removed from {len(stats.setuid_removed)} files (--allow-setuid keeps them)")
    _done(img, time.monotonic() - t0, as_json)


def _done(img, seconds: float, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"digest": img.digest, "names": list(img.names), "entries": img.meta.get("entries"),
                               "bytes": img.meta.get("bytes"), "seconds": round(seconds, 2)}))
    else:
        click.echo(f"{img.digest}  {', '.join(img.names)}  ({img.meta.get('entries')} entries, "
                   f"{(img.meta.get('bytes') or 0) / 1e6:.1f} MB, {seconds:.1f}s)")


@image.command("ls")
@click.option("--json", "as_json", is_flag=True)
def ls_cmd(as_json):
    """The images in the store, with their names."""
    store = _store()
    names = store.names()
    rows = []
    for d in store.digests():
        img = store.get(d)
        rows.append({"digest": d, "names": sorted(n for n, v in names.items() if v == d),
                     "source": img.meta.get("source"), "bytes": img.meta.get("bytes"),
                     "signatures": len(list(store.sig_dir(d).glob("*.sig"))) if store.sig_dir(d).is_dir() else 0})
    if as_json:
        click.echo(json.dumps(rows))
        return 0
    if not rows:
        click.echo("no images (agentvm image build FILE, or agentvm image import SOURCE --name NAME)")
    for r in rows:
        click.echo(f"{r['digest'][:19]}  {','.join(r['names']) or '-':<24} {r['source'] or '?':<7} "
                   f"{(r['bytes'] or 0) / 1e6:8.1f} MB  {r['signatures']} signature(s)")
    return 0


@image.command("inspect")
@click.argument("ref")
def inspect_cmd(ref):
    """Everything recorded about an image (JSON)."""
    store = _store()
    img = store.get(ref)
    click.echo(json.dumps({"digest": img.digest, "names": list(img.names), "root": str(img.root), **img.meta},
                          indent=1, sort_keys=True, default=str))


@image.command("rm")
@click.argument("ref")
def rm_cmd(ref):
    """Remove a name (the image too, when no other name points at it) or a digest."""
    for x in _store().remove(ref):
        click.echo(f"removed {x}")


@image.command("gc")
def gc_cmd():
    """Remove images no name points at, and unfinished builds."""
    out = _store().gc()
    click.echo("\n".join(f"removed {x}" for x in out) or "nothing to remove")


@image.command("verify")
@click.argument("ref", required=False)
@click.option("--signers", type=click.Path(dir_okay=False, path_type=Path),
              help="an allowed-signers file (default: <home>/image-signers) to report valid signatures")
def verify_cmd(ref, signers):
    """Recompute an image's digest (all images without REF); exit 1 on any mismatch."""
    from agentvm.images.sign import verified_principals
    from agentvm.paths import default_paths

    store = _store()
    refs = [ref] if ref else store.digests()
    bad = 0
    sfile = signers or (default_paths().home / "image-signers")
    for r in refs:
        ok, why = store.verify(r)
        d = store.resolve(r)
        who = verified_principals(store, d, sfile) if ok and sfile.is_file() else []
        click.echo(f"{d}  {'ok' if ok else 'CORRUPT'}: {why}" + (f"; signed by {', '.join(who)}" if who else ""))
        bad += not ok
    return 1 if bad else 0


@image.command("sign")
@click.argument("ref")
@click.option("--key", required=True, type=click.Path(dir_okay=False, path_type=Path), help="an SSH private key")
def sign_cmd(ref, key):
    """Sign an image's digest with an SSH key (ssh-keygen -Y sign, namespace agentvm-image)."""
    from agentvm.images.sign import sign

    store = _store()
    out = sign(store, ref, key)
    click.echo(f"signed {store.resolve(ref)} ({out.name})")


@image.command("export")
@click.argument("ref")
@click.argument("out")
@click.option("--oci", "oci", is_flag=True, required=True, help="As an OCI image layout (the only format).")
@click.option("--tag", default=None, help="The layout's ref name (default: the image's name).")
def export_cmd(ref, out, oci, tag):
    """Write image REF as an OCI image layout in directory OUT (or a tar on stdout for -), with
    its signatures in the manifest's annotations (docs/images.md)."""
    import sys

    from agentvm.images.export import export_oci

    if out == "-" and sys.stdout.isatty():
        from agentvm.errors import ConfigError

        raise ConfigError("not writing a tar to a terminal", hint="redirect stdout to a file, or give a directory")
    got = export_oci(_store(), ref, out, tag=tag, stream=sys.stdout.buffer if out == "-" else None)
    if out == "-":
        sys.stdout.buffer.flush()
    _say(f"exported {got['image']} as {got['manifest']} ({got['layer_bytes'] / 1e6:.1f} MB layer, "
         f"{got['signatures']} signature(s)); push with: skopeo copy oci:{out if out != '-' else 'DIR'}:{got['tag']} "
         f"docker://REGISTRY/NAME:{got['tag']}")
    if out != "-":
        click.echo(json.dumps(got))


@image.command("verify-oci")
@click.argument("layout", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--signers", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="an allowed-signers file: report (and require, with --require-signed) valid signatures")
@click.option("--ref", default=None, help="the image's ref name in the layout")
@click.option("--require-signed", is_flag=True, help="exit 1 unless a signer of --signers signed it")
def verify_oci_cmd(layout, signers, ref, require_signed):
    """Check an exported (and copied) OCI layout: blobs, diff_ids, the tree, the signatures."""
    from agentvm.images.export import verify_layout

    got = verify_layout(layout, signers, ref=ref)
    click.echo(json.dumps(got))
    if require_signed and not got["signed_by"]:
        from agentvm.errors import PolicyDenied

        raise PolicyDenied(f"{layout}: no valid signature of {got['tree']}", code="image.unsigned")
