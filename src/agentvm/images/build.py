"""``agentvm image build FILE``: a declarative image file, built with Debian's ``mmdebstrap``.

::

    apiVersion: agentvm/v1
    kind: Image
    metadata: {name: py311}
    spec:
      suite: bookworm              # a Debian suite the host's apt sources serve
      variant: essential           # essential | minbase | apt (mmdebstrap's variants)
      packages: [python3, curl]
      files:                       # host files or folders copied in (relative to this file)
        - {src: app/, dest: /opt/app}
      run:                         # commands run in the new tree: as its root, no network
        - python3 -m compileall -q /opt/app
      epoch: 0                     # SOURCE_DATE_EPOCH: fixed times, a reproducible tarball

The packages come from the host's own apt sources (``/etc/apt/sources.list`` and
``sources.list.d``): no mirror is named here, and the operator's mirror or proxy applies.
``run`` commands execute in a bubblewrap sandbox whose root is the tree being built, with
no network at all; their output is shown as it comes. ``pip`` and ``npm`` packages are
installed through the egress gate (docs/images.md).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agentvm.errors import ConfigError
from agentvm.images import NAME_RE, ImageError, Image, Store
from agentvm.images.layers import Limits, Stats, apply_layer, copy_in

MMDEBSTRAP_TIMEOUT = 1800
RUN_TIMEOUT = 600


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileCopy(_M):
    src: str
    dest: str
    mode: str | None = Field(None, pattern=r"^0?[0-7]{3}$")  # no setuid, setgid or sticky bits


_URL = r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~/-]*)?$"


def _all_match(values: list[str], pattern: str, what: str) -> list[str]:
    """A validator's body: every value matches ``pattern`` (whole), else ``VALUE is not WHAT``."""
    import re

    for p in values:
        if not re.fullmatch(pattern, p):
            raise ValueError(f"{p!r} is not {what}")
    return values


class _RegistrySpec(_M):
    """Packages from a registry (pip, npm), reached through the gate only."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    packages: list[str] = Field(min_length=1)
    hosts: dict[str, str] = Field(default_factory=dict)  # name -> address for the gate (a private registry)

    @property
    def url(self) -> str:
        raise NotImplementedError

    def allow(self) -> list[str]:
        """The egress the install gets: the registry's host and port, nothing else."""
        from urllib.parse import urlsplit

        u = urlsplit(self.url)
        return [f"{u.hostname}:{u.port or (443 if u.scheme == 'https' else 80)}"]


class PipSpec(_RegistrySpec):
    index_url: str = Field("https://pypi.org/simple/", alias="indexUrl", pattern=_URL)

    @field_validator("packages")
    @classmethod
    def _reqs(cls, v: list[str]) -> list[str]:
        return _all_match(v, r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?([<>=!~]=?[A-Za-z0-9.*+!-]+)?",
                          "a requirement (NAME[EXTRAS][==VERSION]; no URLs, no options)")

    @property
    def url(self) -> str:
        return self.index_url

    def allow(self) -> list[str]:
        out = super().allow()
        if out[0].startswith("pypi.org:"):
            out.append("files.pythonhosted.org:443")  # where pypi.org's files are
        return out


class NpmSpec(_RegistrySpec):
    registry: str = Field("https://registry.npmjs.org/", pattern=_URL)

    @field_validator("packages")
    @classmethod
    def _pkgs(cls, v: list[str]) -> list[str]:
        return _all_match(v, r"(@[a-z0-9][a-z0-9._-]*/)?[a-z0-9][a-z0-9._-]*(@[A-Za-z0-9.^~<>=*+-]+)?",
                          "an npm package (NAME or @SCOPE/NAME, optionally @VERSION)")

    @property
    def url(self) -> str:
        return self.registry


class ImageSpec(_M):
    suite: str = Field("bookworm", pattern=r"^[a-z][a-z0-9-]{1,30}$")
    variant: Literal["essential", "minbase", "apt"] = "essential"
    packages: list[str] = Field(default_factory=list)
    pip: PipSpec | None = None
    npm: NpmSpec | None = None
    files: list[FileCopy] = Field(default_factory=list)
    run: list[str] = Field(default_factory=list)
    epoch: int = Field(0, ge=0)

    @field_validator("packages")
    @classmethod
    def _pkgs(cls, v: list[str]) -> list[str]:
        return _all_match(v, r"[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+~:-]+)?",
                          "a Debian package name (name or name=version)")


class Meta(_M):
    name: str

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError("lower-case letters, digits, '.', '_' and '-', starting with a letter or digit")
        return v


class ImageFile(_M):
    api_version: Literal["agentvm/v1"] = Field(alias="apiVersion")
    kind: Literal["Image"]
    metadata: Meta
    spec: ImageSpec = Field(default_factory=ImageSpec)


def load(path: Path) -> ImageFile:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    if len(text) > 1024 * 1024:
        raise ConfigError(f"{path}: an image file over 1 MiB")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML ({exc})") from None
    try:
        return ImageFile.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ConfigError(f"{path}: {where}: {first['msg']}",
                          hint="see docs/images.md for the image file format") from None


def host_sources() -> list[str]:
    """The host's apt source files, handed to mmdebstrap as they are."""
    out = []
    if Path("/etc/apt/sources.list").is_file() and any(
            ln.strip() and not ln.lstrip().startswith("#") for ln in Path("/etc/apt/sources.list").read_text().splitlines()):
        out.append("/etc/apt/sources.list")
    d = Path("/etc/apt/sources.list.d")
    if d.is_dir():
        out += sorted(str(p) for p in d.iterdir() if p.suffix in (".list", ".sources") and p.is_file())
    if not out:
        raise ImageError("the host has no apt sources to build from", code="image.no-sources",
                         hint="configure /etc/apt/sources.list(.d) as for apt-get")
    return out


def check(path: Path) -> ImageFile:
    """An image file, valid, whose ``files`` exist beside it (``agentvm validate`` and the
    start of a build: checked before a long build, not after). Raises ConfigError."""
    f = load(path)
    base = Path(path).resolve().parent
    for fc in f.spec.files:
        src = (base / fc.src).resolve()
        if src != base and base not in src.parents:
            raise ConfigError(f"{path}: files: {fc.src} is outside the build file's folder ({base})",
                              hint="a build copies only what sits beside its file: copy what you need there first")
        if not src.exists():
            raise ConfigError(f"{path}: files: {fc.src} does not exist (relative to {base})")
    return f


def build(store: Store, path: Path, *, progress: Callable[[str], None] = lambda s: None,
          bwrap: str | None = None) -> tuple[Image, Stats]:
    import shutil

    f = check(path)
    spec = f.spec
    exe = shutil.which("mmdebstrap")
    if exe is None:
        raise ImageError("mmdebstrap is not installed", code="image.no-mmdebstrap",
                         hint="apt-get install mmdebstrap (scripts/install.sh does)")
    base = Path(path).resolve().parent
    staging = store.staging()
    root = staging / "root"
    root.mkdir(mode=0o755)
    try:
        with tempfile.TemporaryDirectory(dir=staging) as td:
            tarball = Path(td) / "rootfs.tar"
            # no device nodes in the tree (the sandbox has its own /dev); no docs (smaller)
            argv = [exe, f"--variant={spec.variant}", "--mode=root", "--format=tar", "--skip=output/dev"]
            if spec.packages:
                argv.append("--include=" + ",".join(spec.packages))
            argv += [spec.suite, str(tarball), *host_sources()]
            env = {**os.environ, "SOURCE_DATE_EPOCH": str(spec.epoch), "LC_ALL": "C.UTF-8"}
            progress(f"mmdebstrap {spec.suite} ({spec.variant}) + {len(spec.packages)} packages")
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL)
            tail: list[str] = []
            try:
                for raw in proc.stdout:
                    line = raw.decode(errors="replace").rstrip()
                    tail = (tail + [line])[-20:]
                    if line.startswith(("I: ", "E: ", "W: ")):
                        progress("  " + line)
                rc = proc.wait(timeout=MMDEBSTRAP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise ImageError(f"mmdebstrap took over {MMDEBSTRAP_TIMEOUT}s", code="image.build-failed") from None
            if rc != 0:
                raise ImageError(f"mmdebstrap failed (exit {rc}): " + " | ".join(tail[-5:]), code="image.build-failed",
                                 hint="a package name or the suite may be wrong; the lines above say which")
            progress("unpacking into the image tree")
            stats = Stats()
            with open(tarball, "rb") as t:
                apply_layer(t, root, Limits(), stats, "the mmdebstrap tarball")
        if spec.pip is not None:
            root = _registry_step(store, root, staging, "pip", spec.pip, progress)
        if spec.npm is not None:
            root = _registry_step(store, root, staging, "npm", spec.npm, progress)
        for fc in spec.files:
            progress(f"copying {fc.src} -> {fc.dest}")
            copy_in(root, (base / fc.src).resolve(), fc.dest, int(fc.mode, 8) if fc.mode else None)
        for cmd in spec.run:
            progress(f"run: {cmd}")
            _run_in(root, cmd, bwrap, progress)
        progress("hashing the tree")
        meta = {"source": "build", "file": str(Path(path).resolve()), "name": f.metadata.name,
                "spec": spec.model_dump(), "setuid_removed": stats.setuid_removed[:100]}
        img = store.commit(root, meta, f.metadata.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return img, stats


REGISTRY_TIMEOUT = "20m"


def _registry_step(store: Store, root: Path, staging: Path, kind: str, spec, progress) -> Path:
    """pip or npm packages, installed by the image's own pip or npm in an agent-vm sandbox on the
    image so far: its only route out is the egress gate, to the package registry and nothing
    else; what they write (under a granted folder: pip ``--root``, npm ``--prefix``) is applied
    to the tree as one more layer, with every check a layer gets. -> the new tree."""
    import shutil
    import sys
    import tarfile
    from urllib.parse import urlsplit

    progress(f"{kind}: {len(spec.packages)} packages from {spec.url} (through the gate: {', '.join(spec.allow())} only)")
    interim = store.commit(root, {"source": "build-interim"})
    # the grant is outside agent-vm's home (a sandbox is never granted agent-vm's own state)
    out = Path(tempfile.mkdtemp(prefix=f"agentvm-{kind}-"))
    os.chmod(out, 0o755)
    try:
        argv = [sys.executable, "-m", "agentvm", "run", "--image", interim.digest, "--mount", f"{out}:/out:rw",
                "--timeout", REGISTRY_TIMEOUT, "--memory", "2G"]
        for a in spec.allow():
            argv += ["--allow", a]
        for name, addr in sorted(spec.hosts.items()):
            argv += ["--add-host", f"{name}={addr}"]
        if kind == "pip":
            argv += ["--", "python3", "-m", "pip", "install", "--root", "/out", "--no-cache-dir",
                     "--disable-pip-version-check", "--no-warn-script-location", "--break-system-packages",
                     "--index-url", spec.index_url]
            if spec.index_url.startswith("http://"):
                argv += ["--trusted-host", urlsplit(spec.index_url).hostname]
            argv += spec.packages
            hint = "the image needs python3-pip in its packages; the index must serve the packages"
        else:
            argv += ["--env", "HOME=/tmp", "--", "npm", "install", "--global", "--prefix", "/out/usr/local",
                     "--registry", spec.registry, "--no-audit", "--no-fund", "--no-update-notifier", "--ignore-scripts",
                     *spec.packages]
            hint = "the image needs npm in its packages; the registry must serve the packages"
        env = {**os.environ, "AGENTVM_NO_DAEMON": "1"}
        r = subprocess.run(argv, capture_output=True, env=env, stdin=subprocess.DEVNULL, timeout=1500)
        for line in r.stdout.decode(errors="replace").splitlines()[-8:]:
            progress("  " + line)
        if r.returncode != 0:
            tail = (r.stdout + r.stderr).decode(errors="replace").strip().splitlines()[-6:]
            raise ImageError(f"{kind} install failed (exit {r.returncode}): " + " | ".join(tail),
                             code="image.build-failed", hint=hint)
        final = staging / f"root-{kind}"
        subprocess.run(["cp", "-a", "--", str(interim.root), str(final)], check=True)
        layer = staging / f"{kind}-layer.tar"
        with tarfile.open(layer, "w") as t:
            t.add(out, arcname=".")  # links are stored as links (never followed)
        with open(layer, "rb") as f:
            apply_layer(f, final, Limits(), Stats(), f"what {kind} installed")
        layer.unlink()
        return final
    finally:
        shutil.rmtree(out, ignore_errors=True)
        if interim.digest not in store.names().values():
            store._drop(interim.digest)


RUN_PREFIX = "  | "  # a build command's own output, as it comes, in the build's progress


def _printable(line: str) -> str:
    """One line of a build command's output for the terminal: control characters (escapes that
    could move the cursor or retitle the window) shown as ``\\xNN``."""
    return "".join(c if c.isprintable() or c == "\t" else f"\\x{ord(c):02x}" for c in line)


def _run_in(root: Path, cmd: str, bwrap: str | None, progress: Callable[[str], None] = lambda s: None) -> None:
    """A build command, with the tree as its root and no network (bubblewrap, as root). Its
    output (stdout and stderr, merged) goes to ``progress`` line by line as it comes, prefixed
    with RUN_PREFIX; the last lines are kept for the error when it fails."""
    import shutil
    import threading

    exe = bwrap or shutil.which("bwrap")
    if exe is None:
        raise ImageError("bwrap is needed to run build commands", code="image.no-bwrap")
    # no capabilities (no setcap, no chown to others, no mknod); what the command leaves in the
    # tree is sanitized before it is stored (no setuid, no xattrs, nothing writable by others)
    argv = [exe, "--bind", str(root), "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--unshare-all", "--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "ALL",
            "--setenv", "PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--setenv", "HOME", "/root", "--setenv", "LC_ALL", "C.UTF-8", "--chdir", "/",
            "/bin/sh", "-c", cmd]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        proc.kill()

    timer = threading.Timer(RUN_TIMEOUT, kill)
    timer.daemon = True
    timer.start()
    tail: list[str] = []
    try:
        while True:
            raw = proc.stdout.readline(65536)  # a longer line comes in pieces, never whole in memory
            if not raw:
                break
            line = _printable(raw.decode(errors="replace").rstrip("\r\n"))
            tail = (tail + [line])[-5:]
            progress(RUN_PREFIX + line)
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    if timed_out.is_set():
        raise ImageError(f"run: {cmd!r} took over {RUN_TIMEOUT}s", code="image.build-failed")
    if rc != 0:
        raise ImageError(f"run: {cmd!r} failed (exit {rc}): " + " | ".join(tail), code="image.build-failed",
                         hint="build commands have no network: copy what they need in with `files`")
