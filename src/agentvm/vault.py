"""The vault: the real values behind credential placeholders, kept outside every sandbox.

Agents only ever see placeholders; the egress gate (outside the sandbox) swaps the real
value in on the way out. The vault is where those real values live::

    <state>/vault/            0700, owned by agent-vm's uid
      key                     32 random bytes (AES-256 key), 0600, created on the first set
      store.json              0600; {name: {"nonce": b64, "ct": b64, "created": t, "updated": t}}
      revocations.json        0600; {"global": {name: t}, "sandboxes": {sandbox_id: {name: t}}}
      .lock                   flock(LOCK_EX) held by every writer

Each value is encrypted with AES-256-GCM, a fresh 12-byte nonce per write and the
associated data ``b"agentvm-vault-v1:" + name``: an entry copied or swapped to another
name does not decrypt (:class:`VaultCorrupt`), nor does a modified one.

Every write is a read-modify-write under the lock, lands in a temp file that is fsynced
and ``os.replace``d over the old one, and gives the file an mtime strictly greater than the
previous version's. The last point makes the stat signature ``(st_mtime_ns, st_size,
st_ino)`` unique per version even when two writes fall in the same kernel clock tick and
the inode number is recycled, so readers can cache by signature:

* :meth:`Vault.is_revoked` is the per-request check of the gate. It costs one
  ``os.stat``; the parsed revocations are re-read only when the signature changed, so a
  ``agentvm secret revoke`` in another process is seen by the very next call.
* :meth:`Vault.version` / :meth:`Vault.changed_since` expose the signature of
  ``store.json`` so a gate can cache decrypted values and reload after a rotation.

Values never appear in exception messages, ``repr``/``str`` of any object here, or logs
(this module logs nothing). Errors name the secret or the reference, never the value.

``cryptography`` is imported lazily: importing this module is cheap.
"""

from __future__ import annotations

import base64
import binascii
import errno
import fcntl
import json
import math
import os
import re
import secrets
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from agentvm.fsutil import write_atomic
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from agentvm.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from agentvm.paths import Paths

__all__ = [
    "Vault",
    "SecretInfo",
    "VaultError",
    "SecretNotFound",
    "VaultKeyInsecure",
    "VaultInsecure",
    "VaultCorrupt",
    "InvalidSecretName",
    "InvalidSecretValue",
    "InvalidReference",
    "UnresolvedReference",
    "default_vault",
    "validate_name",
    "validate_value",
    "MAX_VALUE_BYTES",
]

KEY_FILE = "key"
STORE_FILE = "store.json"
REVOCATIONS_FILE = "revocations.json"
LOCK_FILE = ".lock"

KEY_BYTES = 32
NONCE_BYTES = 12
AAD_PREFIX = b"agentvm-vault-v1:"
#: The largest value (UTF-8 bytes) the vault stores or a reference resolves to.
MAX_VALUE_BYTES = 64 * 1024
#: A store/revocations file larger than this is refused as corrupt.
_MAX_FILE_BYTES = 256 * 1024 * 1024

# Has this process held a secret (the vault's key, a value, an env:/file: reference's text)?
# Once it has, a child forked from it carries the secret in its copy of the heap (freed text
# is not wiped): the embedded gate forks its worker from this process only before
# (agentvm.gate.embedded.LazyGate), and starts a fresh interpreter after.
_HELD_SECRETS = False


def held_secrets() -> bool:
    """Whether this process has read a secret (see ``_HELD_SECRETS``)."""
    return _HELD_SECRETS


def _holding() -> None:
    global _HELD_SECRETS
    _HELD_SECRETS = True

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")
_ENV_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]{0,15}\Z")


# ---------------------------------------------------------------------------------- errors
class VaultError(ConfigError):
    """The vault cannot do what was asked as it is on disk or with the input given."""

    code = "vault.error"


class SecretNotFound(VaultError):
    code = "vault.not-found"


class VaultKeyInsecure(VaultError):
    """The key file is readable by others, owned by someone else or not a regular file."""

    code = "vault.key-insecure"


class VaultInsecure(VaultError):
    """The vault directory or one of its files can be modified by someone else."""

    code = "vault.insecure"


class VaultCorrupt(VaultError):
    """A file of the vault cannot be parsed, or an entry does not decrypt."""

    code = "vault.corrupt"


class InvalidSecretName(VaultError):
    code = "vault.invalid-name"


class InvalidSecretValue(VaultError):
    code = "vault.invalid-value"


class InvalidReference(VaultError):
    """A credential reference is not ``vault:NAME``, ``env:VAR`` or ``file:/abs/path``."""

    code = "vault.ref-invalid"


class UnresolvedReference(VaultError):
    """A well-formed reference whose value cannot be obtained (unset variable, missing file)."""

    code = "vault.ref-unresolved"


# ---------------------------------------------------------------------------------- public data
@dataclass(frozen=True, slots=True)
class SecretInfo:
    """What may be shown about a secret. Holds no value, so its default repr is safe."""

    name: str
    created: float
    updated: float
    revoked: bool  # revoked globally
    revoked_sandboxes: tuple[str, ...] = ()  # sandboxes it is revoked for (besides globally)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "created": self.created,
            "updated": self.updated,
            "revoked": self.revoked,
            "revoked_sandboxes": list(self.revoked_sandboxes),
        }


def validate_name(name: object) -> str:
    """Return ``name`` if it is a valid secret name (1-64 of ``[A-Za-z0-9_.-]``)."""
    if not isinstance(name, str) or not _NAME.match(name):
        # not echoed: what was typed where a name belongs may be a value
        raise InvalidSecretName("invalid secret name: use 1-64 letters, digits, '_', '.' or '-'")
    return name


def validate_value(value: object, what: str) -> bytes:
    """The UTF-8 bytes of a value, or InvalidSecretValue. ``what`` names it (never the value)."""
    if not isinstance(value, str):
        raise InvalidSecretValue(f"{what}: the value must be a string, not {type(value).__name__}")
    if not value:
        raise InvalidSecretValue(f"{what}: the value is empty")
    if "\x00" in value:
        raise InvalidSecretValue(f"{what}: the value contains a NUL character")
    data = _encode(value)
    if data is None:
        raise InvalidSecretValue(f"{what}: the value is not valid Unicode (lone surrogate)")
    if len(data) > MAX_VALUE_BYTES:
        raise InvalidSecretValue(f"{what}: the value is {len(data)} bytes; at most {MAX_VALUE_BYTES} are allowed")
    return data


def _validate_sandbox(sandbox_id: object) -> str:
    if not isinstance(sandbox_id, str) or not sandbox_id or len(sandbox_id) > 256 or not sandbox_id.isprintable():
        raise VaultError("the sandbox id must be a non-empty printable string of at most 256 characters")
    return sandbox_id


# The two helpers below keep Unicode errors out of the exception chain (``__context__``):
# a UnicodeError holds the whole object it failed on, which may be a value.
def _decode(data: bytes) -> str | None:
    """``data`` as UTF-8 text, or None."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _encode(text: str) -> bytes | None:
    """``text`` as UTF-8, or None (lone surrogates)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return None


def _aad(name: str) -> bytes:
    return AAD_PREFIX + name.encode("ascii")


def _b64d(text: object) -> bytes:
    if not isinstance(text, str):
        raise ValueError("not a string")
    return base64.b64decode(text.encode("ascii"), validate=True)


def _b64e(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _is_time(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_EMPTY_REV: tuple[frozenset, dict] = (frozenset(), {})


# ---------------------------------------------------------------------------------- the vault
class Vault:
    """The secrets of one installation, in ``directory`` (``<state>/vault`` by default).

    Creating the object touches nothing on disk; the directory and the key are created by
    the first :meth:`set`. Safe to use from several threads and processes at once.
    """

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self._uid = os.getuid()
        # (signature, global names, {sandbox_id: names}); replaced as a whole (atomic under the GIL)
        self._rev_cache: tuple[Any, frozenset, dict] | None = None

    def __repr__(self) -> str:
        return f"Vault({str(self.directory)!r})"

    __str__ = __repr__

    # --------------------------------------------------------------------------- paths
    @property
    def key_path(self) -> Path:
        return self.directory / KEY_FILE

    @property
    def store_path(self) -> Path:
        return self.directory / STORE_FILE

    @property
    def revocations_path(self) -> Path:
        return self.directory / REVOCATIONS_FILE

    # --------------------------------------------------------------------------- secrets
    def set(self, name: str, value: str) -> bool:
        """Store ``value`` under ``name``, encrypted. Returns True when an existing secret was
        rotated (replaced), False when it was created. Revocations are left as they are."""
        validate_name(name)
        plaintext = validate_value(value, f"secret {name!r}")
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._ensure_dir()
        with self._locked():
            store, st = self._read_json(self.store_path, "store")
            self._check_store_shape(store)
            key = self._load_key(must_exist=False)
            if key is None:
                if store:
                    raise VaultCorrupt(
                        f"the vault key {self.key_path} is missing but {self.store_path} holds "
                        f"{len(store)} secret(s) encrypted with it",
                        hint=f"restore {self.key_path} from a backup, or remove {self.store_path} "
                        "and set every secret again",
                    )
                key = self._create_key()
            nonce = secrets.token_bytes(NONCE_BYTES)
            ct = AESGCM(key).encrypt(nonce, plaintext, _aad(name))
            now = time.time()
            old = store.get(name)
            existed = old is not None
            created = old["created"] if existed and _is_time(old.get("created")) else now
            store[name] = {"nonce": _b64e(nonce), "ct": _b64e(ct), "created": created, "updated": now}
            self._write_json(self.store_path, store, st)
        return existed

    def get(self, name: str) -> str:
        """The plaintext value of ``name``. Does not look at revocations (see :meth:`is_revoked`)."""
        validate_name(name)
        store, _ = self._read_json(self.store_path, "store")
        entry = store.get(name)
        if entry is None:
            raise SecretNotFound(f"no secret named {name!r} in the vault",
                                 hint=f"store it with: agentvm secret set {name}")
        if not isinstance(entry, dict):
            raise VaultCorrupt(f"the entry of secret {name!r} in {self.store_path} is malformed")
        try:
            nonce = _b64d(entry.get("nonce"))
            ct = _b64d(entry.get("ct"))
        except (ValueError, binascii.Error):
            raise VaultCorrupt(f"the entry of secret {name!r} in {self.store_path} is malformed (bad base64)") from None
        if len(nonce) != NONCE_BYTES or len(ct) < 16:
            raise VaultCorrupt(f"the entry of secret {name!r} in {self.store_path} is malformed (bad lengths)")
        key = self._load_key(must_exist=False)
        if key is None:
            raise VaultCorrupt(
                f"the vault key {self.key_path} is missing; secret {name!r} cannot be decrypted",
                hint=f"restore {self.key_path} from a backup, or remove {self.store_path} and set every secret again",
            )
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        try:
            data = AESGCM(key).decrypt(nonce, ct, _aad(name))
        except InvalidTag:
            raise VaultCorrupt(
                f"secret {name!r} does not decrypt: its entry in {self.store_path} was modified, "
                "copied from another name, or encrypted with another key",
                hint=f"set it again: agentvm secret set {name}",
            ) from None
        text = _decode(data)
        if text is None:
            raise VaultCorrupt(f"secret {name!r} decrypts to invalid UTF-8")
        return text

    def exists(self, name: str) -> bool:
        validate_name(name)
        store, _ = self._read_json(self.store_path, "store")
        return name in store

    def list(self) -> list[SecretInfo]:
        """Every secret's name, times and revocation state, sorted by name. Never a value."""
        store, _ = self._read_json(self.store_path, "store")
        self._check_store_shape(store)
        _, glob, sandboxes = self._revocations()
        out = []
        for name in sorted(store):
            e = store[name]
            out.append(SecretInfo(
                name=name,
                created=float(e["created"]),
                updated=float(e["updated"]),
                revoked=name in glob,
                revoked_sandboxes=tuple(sorted(s for s, names in sandboxes.items() if name in names)),
            ))
        return out

    def remove(self, name: str) -> None:
        """Delete ``name`` and every revocation of it. SecretNotFound if it does not exist."""
        validate_name(name)
        if not self.directory.exists():
            raise SecretNotFound(f"no secret named {name!r} in the vault")
        self._check_dir()
        with self._locked():
            store, st = self._read_json(self.store_path, "store")
            if name not in store:
                raise SecretNotFound(f"no secret named {name!r} in the vault")
            rev, rst = self._read_revocations_locked()
            changed = rev["global"].pop(name, None) is not None
            for sid in list(rev["sandboxes"]):
                if rev["sandboxes"][sid].pop(name, None) is not None:
                    changed = True
                if not rev["sandboxes"][sid]:
                    del rev["sandboxes"][sid]
            del store[name]
            # store first: a crash in between leaves a stale revocation, never an unrevoked secret
            self._write_json(self.store_path, store, st)
            if changed:
                self._write_json(self.revocations_path, rev, rst)

    # --------------------------------------------------------------------------- revocation
    def revoke(self, name: str, sandbox_id: str | None = None) -> bool:
        """Stop the gate from substituting ``name`` - everywhere, or only for ``sandbox_id``.
        Returns False when it was already revoked there. SecretNotFound for unknown names."""
        return self._set_revoked(name, sandbox_id, True)

    def restore(self, name: str, sandbox_id: str | None = None) -> bool:
        """Undo :meth:`revoke` (the same scope). Returns False when it was not revoked there.
        Restoring globally does not lift per-sandbox revocations, nor the reverse."""
        return self._set_revoked(name, sandbox_id, False)

    def _set_revoked(self, name: str, sandbox_id: str | None, revoked: bool) -> bool:
        validate_name(name)
        if sandbox_id is not None:
            _validate_sandbox(sandbox_id)
        if not self.directory.exists():
            raise SecretNotFound(f"no secret named {name!r} in the vault")
        self._check_dir()
        with self._locked():
            rev, rst = self._read_revocations_locked()
            table = rev["global"] if sandbox_id is None else rev["sandboxes"].setdefault(sandbox_id, {})
            if revoked:
                store, _ = self._read_json(self.store_path, "store")
                if name not in store:
                    raise SecretNotFound(f"no secret named {name!r} in the vault")
                if name in table:
                    return False
                table[name] = time.time()
            else:
                if name not in table:
                    return False
                del table[name]
                if sandbox_id is not None and not table:
                    del rev["sandboxes"][sandbox_id]
            self._write_json(self.revocations_path, rev, rst)
            return True

    def is_revoked(self, name: str, sandbox_id: str | None = None) -> bool:
        """Is ``name`` revoked globally or (when given) for ``sandbox_id``?

        Cheap enough for every request: one ``os.stat``; the file is parsed again only when
        its signature changed, so a revocation written by any process is seen at once.
        Raises VaultError (fail closed) when the revocations file is unsafe or corrupt.
        """
        return self.any_revoked((name,), sandbox_id)

    def any_revoked(self, names: tuple[str, ...], sandbox_id: str | None = None) -> bool:
        """Is one of ``names`` revoked (as :meth:`is_revoked`), with one look at the file."""
        _, glob, sandboxes = self._revocations()
        local = sandboxes.get(sandbox_id) if sandbox_id is not None else None
        return any(n in glob or (local is not None and n in local) for n in names)

    def _revocations(self) -> tuple[Any, frozenset, dict]:
        path = self.revocations_path
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        except NotADirectoryError:
            st = None
        except OSError as exc:
            raise VaultError(f"cannot stat {path}: {exc.strerror or exc}") from exc
        cache = self._rev_cache
        if st is None:
            if cache is None or cache[0] is not None:
                cache = self._rev_cache = (None, *_EMPTY_REV)
            return cache
        if st.st_uid != self._uid or st.st_mode & 0o022:
            self._rev_cache = None
            self._check_file_stat(path, st, "revocations file")
        sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        if cache is not None and cache[0] == sig:
            return cache
        data, fst = self._read_json(path, "revocations file")
        self._check_rev_shape(data)
        new = (
            (fst.st_mtime_ns, fst.st_size, fst.st_ino) if fst is not None else None,
            frozenset(data.get("global", {})),
            {sid: frozenset(names) for sid, names in data.get("sandboxes", {}).items()},
        )
        self._rev_cache = new
        return new

    def _read_revocations_locked(self) -> tuple[dict, os.stat_result | None]:
        rev, rst = self._read_json(self.revocations_path, "revocations file")
        self._check_rev_shape(rev)
        rev.setdefault("global", {})
        rev.setdefault("sandboxes", {})
        return rev, rst

    # --------------------------------------------------------------------------- versions
    def version(self) -> tuple[int, int, int] | None:
        """The stat signature of ``store.json`` - ``(st_mtime_ns, st_size, st_ino)``, or None
        when there is none. It changes with every set/remove (rotation included)."""
        try:
            st = os.stat(self.store_path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def changed_since(self, token: Any) -> tuple[bool, Any]:
        """``(changed, new_token)``: has the store changed since ``token`` (a previous
        :meth:`version`)? Cache decrypted values with the token; reload when changed."""
        now = self.version()
        return now != token, now

    # --------------------------------------------------------------------------- references
    def resolve(self, ref: str, *, environ: Mapping[str, str] = os.environ) -> str:
        """The value behind a credential reference: ``vault:NAME``, ``env:VAR`` (of agent-vm's
        own environment) or ``file:/abs/path`` (content minus one trailing newline)."""
        if not isinstance(ref, str):
            raise InvalidReference("a credential reference must be a string")
        _holding()
        kind, sep, rest = ref.partition(":")
        if not sep or kind not in ("vault", "env", "file"):
            # never echo the whole string: a value pasted where a reference belongs must not leak
            shown = f" (scheme '{kind}:')" if sep and _SCHEME.match(kind) else ""
            raise InvalidReference(
                f"a credential reference{shown} is not vault:NAME, env:VAR or file:/absolute/path",
                hint="store the value with `agentvm secret set NAME` and refer to it as vault:NAME",
            )
        if kind == "vault":
            if not isinstance(rest, str) or not _NAME.match(rest):
                raise InvalidReference("a vault: reference needs a secret name of 1-64 letters, digits, '_', '.' or '-'")
            return self.get(rest)
        if kind == "env":
            if not _ENV_VAR.match(rest):
                raise InvalidReference("an env: reference needs an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
            value = environ.get(rest)
            if value is None:
                raise UnresolvedReference(f"env:{rest}: the variable {rest} is not set in agent-vm's environment")
            if value == "":
                raise UnresolvedReference(f"env:{rest}: the variable {rest} is empty")
            validate_value(value, f"env:{rest}")
            return value
        return _read_file_ref(rest)

    # --------------------------------------------------------------------------- internals
    def _ensure_dir(self) -> None:
        d = self.directory
        try:
            d.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(d, 0o700)
            os.chmod(d, 0o700)  # the umask may have removed bits, never added: make it exact
        except FileExistsError:
            pass
        except OSError as exc:
            raise VaultError(f"cannot create the vault directory {d}: {exc.strerror or exc}",
                             hint="set AGENTVM_HOME to a directory agent-vm's user can write") from exc
        self._check_dir()

    def _check_dir(self) -> None:
        d = self.directory
        try:
            st = os.stat(d)
        except OSError as exc:
            raise VaultError(f"cannot stat the vault directory {d}: {exc.strerror or exc}") from exc
        if not stat.S_ISDIR(st.st_mode):
            raise VaultError(f"{d} is not a directory")
        if st.st_uid != self._uid:
            raise VaultInsecure(f"the vault directory {d} is owned by uid {st.st_uid}, not by uid {self._uid}",
                                hint=f"chown {self._uid} {d}")
        if st.st_mode & 0o077:
            raise VaultInsecure(
                f"the vault directory {d} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700",
                hint=f"chmod 700 {d}",
            )

    @contextmanager
    def _locked(self) -> Iterator[None]:
        path = self.directory / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise VaultError(f"cannot open the vault lock {path}: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _load_key(self, *, must_exist: bool) -> bytes | None:
        _holding()
        path = self.key_path
        self._check_dir()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            if must_exist:
                raise VaultCorrupt(f"the vault key {path} is missing") from None
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise VaultKeyInsecure(f"the vault key {path} is a symbolic link",
                                       hint=f"replace {path} with the key file itself (mode 0600)") from None
            raise VaultError(f"cannot open the vault key {path}: {exc.strerror or exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise VaultKeyInsecure(f"the vault key {path} is not a regular file")
            if st.st_uid != self._uid:
                raise VaultKeyInsecure(
                    f"the vault key {path} is owned by uid {st.st_uid}, not by uid {self._uid}",
                    hint=f"chown {self._uid} {path} && chmod 600 {path} (and consider whether someone else "
                    "could have read it: if so, rotate every secret in the vault)",
                )
            if stat.S_IMODE(st.st_mode) & 0o077:
                raise VaultKeyInsecure(
                    f"the vault key {path} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0600",
                    hint=f"chmod 600 {path} - and if others could read it, rotate every secret in the vault",
                )
            data = os.read(fd, KEY_BYTES + 1)
        finally:
            os.close(fd)
        if len(data) != KEY_BYTES:
            raise VaultCorrupt(f"the vault key {path} is {len(data)} bytes long, not {KEY_BYTES}",
                               hint=f"restore {path} from a backup")
        return data

    def _create_key(self) -> bytes:
        key = secrets.token_bytes(KEY_BYTES)
        _write_atomic(self.key_path, key, 0o600)
        return key

    def _check_file_stat(self, path: Path, st: os.stat_result, what: str) -> None:
        if not stat.S_ISREG(st.st_mode):
            raise VaultInsecure(f"the vault {what} {path} is not a regular file")
        if st.st_uid != self._uid:
            raise VaultInsecure(f"the vault {what} {path} is owned by uid {st.st_uid}, not by uid {self._uid}",
                                hint=f"chown {self._uid} {path} && chmod 600 {path}")
        if st.st_mode & 0o022:
            raise VaultInsecure(
                f"the vault {what} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})",
                hint=f"chmod 600 {path}",
            )

    def _read_json(self, path: Path, what: str) -> tuple[dict, os.stat_result | None]:
        """The JSON object in ``path`` ({} when absent) and the fstat of what was read."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            return {}, None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise VaultInsecure(f"the vault {what} {path} is a symbolic link") from None
            raise VaultError(f"cannot open the vault {what} {path}: {exc.strerror or exc}") from exc
        try:
            st = os.fstat(fd)
            self._check_file_stat(path, st, what)
            if st.st_size > _MAX_FILE_BYTES:
                raise VaultCorrupt(f"the vault {what} {path} is implausibly large ({st.st_size} bytes)")
            chunks = []
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(fd)
        try:
            data = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as exc:
            raise VaultCorrupt(f"the vault {what} {path} is not valid JSON ({type(exc).__name__})",
                               hint=f"restore {path} from a backup") from None
        if not isinstance(data, dict):
            raise VaultCorrupt(f"the vault {what} {path} does not hold a JSON object")
        return data, st

    def _check_store_shape(self, store: dict) -> None:
        for name, e in store.items():
            if (not _NAME.match(name) or not isinstance(e, dict) or not _is_time(e.get("created"))
                    or not _is_time(e.get("updated")) or not isinstance(e.get("nonce"), str)
                    or not isinstance(e.get("ct"), str)):
                raise VaultCorrupt(f"the vault store {self.store_path} has a malformed entry"
                                   + (f" for {name!r}" if _NAME.match(name) else ""),
                                   hint=f"restore {self.store_path} from a backup")

    def _check_rev_shape(self, rev: dict) -> None:
        bad = VaultCorrupt(f"the vault revocations file {self.revocations_path} is malformed",
                           hint=f"fix or remove {self.revocations_path} (removing it lifts every revocation)")
        glob = rev.get("global", {})
        sandboxes = rev.get("sandboxes", {})
        if not isinstance(glob, dict) or not isinstance(sandboxes, dict):
            raise bad
        if not all(isinstance(t, dict) for t in sandboxes.values()):
            raise bad

    def _write_json(self, path: Path, data: dict, prev: os.stat_result | None) -> None:
        """Atomically replace ``path``; the new mtime is strictly after ``prev``'s."""
        raw = json.dumps(data, indent=1, sort_keys=True).encode("utf-8") + b"\n"
        try:
            cur = os.stat(path)  # under the lock: what is there now (prev may be None/stale)
        except FileNotFoundError:
            cur = prev
        floor = max(cur.st_mtime_ns if cur else 0, prev.st_mtime_ns if prev else 0) + 1
        _write_atomic(path, raw, 0o600, mtime_ns=max(time.time_ns(), floor))


def _read_file_ref(path_text: str) -> str:
    ref = f"file:{path_text}"
    if not path_text.startswith("/"):
        raise InvalidReference(f"{ref}: file: references need an absolute path")
    if "\x00" in path_text:
        raise InvalidReference("a file: reference contains a NUL character")
    try:
        fd = os.open(path_text, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise UnresolvedReference(f"{ref}: no such file") from None
    except OSError as exc:
        raise UnresolvedReference(f"{ref}: cannot open: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnresolvedReference(f"{ref}: not a regular file")
        if st.st_size > MAX_VALUE_BYTES + 2:
            raise UnresolvedReference(f"{ref}: the file is {st.st_size} bytes; at most {MAX_VALUE_BYTES} are allowed")
        chunks = []
        total = 0
        while total <= MAX_VALUE_BYTES + 2:
            chunk = os.read(fd, MAX_VALUE_BYTES + 3 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise UnresolvedReference(f"{ref}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    if len(data) > MAX_VALUE_BYTES:
        raise UnresolvedReference(f"{ref}: the file holds more than {MAX_VALUE_BYTES} bytes")
    text = _decode(data)
    if text is None:
        raise UnresolvedReference(f"{ref}: the file is not UTF-8 text")
    if not text:
        raise UnresolvedReference(f"{ref}: the file is empty")
    validate_value(text, ref)
    return text


def _write_atomic(path: Path, data: bytes, mode: int, *, mtime_ns: int | None = None) -> None:
    """Write ``data`` to ``path`` with exactly ``mode`` (see :func:`agentvm.fsutil.write_atomic`)."""
    try:
        write_atomic(path, data, mode, mtime_ns=mtime_ns)
    except OSError as exc:
        raise VaultError(f"cannot write {path}: {exc.strerror or exc}") from exc


def default_vault(paths: "Paths | None" = None) -> Vault:
    """The installation's vault: ``paths.home / "vault"`` (``default_paths()`` when omitted)."""
    if paths is None:
        from agentvm.paths import default_paths

        paths = default_paths()
    return Vault(paths.home / "vault")
