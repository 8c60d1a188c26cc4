"""The vault: encryption at rest, files and modes, refusals, revocations, references, leaks."""

from __future__ import annotations

import base64
import json
import multiprocessing
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import agentvm.vault as vault_mod
from agentvm.errors import EXIT_CONFIG, AgentVMError, ConfigError
from agentvm.vault import (
    MAX_VALUE_BYTES,
    InvalidReference,
    InvalidSecretName,
    InvalidSecretValue,
    SecretInfo,
    SecretNotFound,
    UnresolvedReference,
    Vault,
    VaultCorrupt,
    VaultInsecure,
    VaultKeyInsecure,
    default_vault,
)

CANARY = "CANARY-sk-live-7f3e9a1b2c4d5e6f"


def mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture
def vdir(tmp_path) -> Path:
    return tmp_path / "state" / "vault"


@pytest.fixture
def v(vdir) -> Vault:
    return Vault(vdir)


def load_store(v: Vault) -> dict:
    return json.loads(v.store_path.read_text())


def save_store(v: Vault, data: dict) -> None:
    v.store_path.write_text(json.dumps(data))


# ------------------------------------------------------------------------------ basics
def test_roundtrip_and_rotation(v):
    assert not v.exists("api")
    assert v.set("api", "one") is False
    assert v.get("api") == "one"
    assert v.exists("api")
    [info] = v.list()
    assert isinstance(info, SecretInfo)
    assert (info.name, info.revoked, info.revoked_sandboxes) == ("api", False, ())
    assert info.created == info.updated
    assert v.set("api", "two") is True  # rotated
    assert v.get("api") == "two"
    [info2] = v.list()
    assert info2.created == info.created and info2.updated > info.updated


def test_values_unicode_and_limits(v):
    v.set("u", "pässwörd ✓ with spaces\nand a newline")
    assert v.get("u") == "pässwörd ✓ with spaces\nand a newline"
    v.set("big", "x" * MAX_VALUE_BYTES)
    assert len(v.get("big")) == MAX_VALUE_BYTES
    for bad in ("", "a\x00b", "x" * (MAX_VALUE_BYTES + 1), "é" * (MAX_VALUE_BYTES // 2 + 1), b"bytes", None):
        with pytest.raises(InvalidSecretValue) as ei:
            v.set("bad", bad)
        assert ei.value.code == "vault.invalid-value"
    assert not v.exists("bad")


@pytest.mark.parametrize("name", ["", "a" * 65, "a b", "a/b", "ü", "a:b", "x\n", 3])
def test_invalid_names(v, name):
    with pytest.raises(InvalidSecretName) as ei:
        v.set(name, "value")
    assert ei.value.exit_code == EXIT_CONFIG


def test_valid_names(v):
    for name in ("A", "a" * 64, "GITHUB_TOKEN", "openai.prod-key_2"):
        v.set(name, "v")
    assert [i.name for i in v.list()] == sorted(["A", "a" * 64, "GITHUB_TOKEN", "openai.prod-key_2"])


def test_missing(v):
    with pytest.raises(SecretNotFound) as ei:
        v.get("nope")
    assert ei.value.code == "vault.not-found" and isinstance(ei.value, ConfigError)
    assert v.list() == []
    with pytest.raises(SecretNotFound):
        v.remove("nope")
    with pytest.raises(SecretNotFound):
        v.revoke("nope")
    assert not v.directory.exists()  # reads create nothing


def test_remove(v):
    v.set("a", "1")
    v.set("b", "2")
    v.remove("a")
    assert not v.exists("a") and v.get("b") == "2"
    with pytest.raises(SecretNotFound):
        v.remove("a")


def test_default_vault_respects_agentvm_home(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTVM_HOME", str(tmp_path / "h"))
    assert default_vault().directory == tmp_path / "h" / "vault"


def test_import_does_not_load_cryptography():
    code = "import sys, agentvm.vault; print('cryptography' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ------------------------------------------------------------------------------ files and modes
@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_file_modes(v, vdir, umask):
    old = os.umask(umask)
    try:
        v.set("a", "1")
        v.revoke("a")
    finally:
        os.umask(old)
    assert mode(vdir) == 0o700
    assert mode(vdir / "key") == 0o600
    assert (vdir / "key").stat().st_size == 32
    assert mode(vdir / "store.json") == 0o600
    assert mode(vdir / "revocations.json") == 0o600
    assert mode(vdir / ".lock") == 0o600
    assert not [p for p in vdir.iterdir() if p.name.endswith(".tmp")]


def test_store_format(v):
    v.set("a", "1")
    e = load_store(v)["a"]
    assert set(e) == {"nonce", "ct", "created", "updated"}
    assert len(base64.b64decode(e["nonce"])) == 12
    first = e["nonce"]
    v.set("a", "1")
    assert load_store(v)["a"]["nonce"] != first  # fresh nonce per write


@pytest.mark.parametrize("bits", [0o640, 0o604, 0o644, 0o660, 0o610, 0o601])
def test_insecure_key_mode_refused(v, bits):
    v.set("a", "1")
    os.chmod(v.key_path, bits)
    for op in (lambda: v.get("a"), lambda: v.set("b", "2")):
        with pytest.raises(VaultKeyInsecure) as ei:
            op()
        assert ei.value.code == "vault.key-insecure"
        assert f"chmod 600 {v.key_path}" in ei.value.hint
    os.chmod(v.key_path, 0o600)
    assert v.get("a") == "1"
    os.chmod(v.key_path, 0o400)  # stricter is fine
    assert v.get("a") == "1"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_key_owned_by_someone_else_refused(v):
    v.set("a", "1")
    os.chown(v.key_path, 54321, -1)
    with pytest.raises(VaultKeyInsecure) as ei:
        v.get("a")
    assert "chown" in ei.value.hint and "54321" in ei.value.message


def test_key_symlink_refused(v, tmp_path):
    v.set("a", "1")
    real = tmp_path / "realkey"
    real.write_bytes(v.key_path.read_bytes())
    os.chmod(real, 0o600)
    v.key_path.unlink()
    v.key_path.symlink_to(real)
    with pytest.raises(VaultKeyInsecure):
        v.get("a")


def test_key_wrong_length_is_corrupt(v):
    v.set("a", "1")
    v.key_path.write_bytes(b"short")
    with pytest.raises(VaultCorrupt):
        v.get("a")


def test_lost_key_with_secrets_is_not_silently_replaced(v):
    v.set("a", "1")
    v.key_path.unlink()
    with pytest.raises(VaultCorrupt) as ei:
        v.get("a")
    assert "missing" in ei.value.message
    with pytest.raises(VaultCorrupt):
        v.set("b", "2")  # would create a new key the old entries cannot use
    assert not v.key_path.exists()


def test_insecure_directory_refused(v, vdir):
    v.set("a", "1")
    os.chmod(vdir, 0o755)
    with pytest.raises(VaultInsecure) as ei:
        v.get("a")
    assert "chmod 700" in ei.value.hint
    with pytest.raises(VaultInsecure):
        v.set("b", "2")


def test_writable_store_or_revocations_refused(v):
    v.set("a", "1")
    v.revoke("a", "sb")
    os.chmod(v.store_path, 0o666)
    with pytest.raises(VaultInsecure):
        v.get("a")
    os.chmod(v.store_path, 0o600)
    os.chmod(v.revocations_path, 0o620)
    with pytest.raises(VaultInsecure):  # fail closed, also on the cached hot path
        v.is_revoked("a", "sb")
    os.chmod(v.revocations_path, 0o600)
    assert v.is_revoked("a", "sb")


# ------------------------------------------------------------------------------ tampering
def test_swapped_ciphertexts_fail_to_decrypt(v):
    v.set("alpha", "value-of-alpha")
    v.set("bravo", "value-of-bravo")
    s = load_store(v)
    s["alpha"], s["bravo"] = s["bravo"], s["alpha"]
    save_store(v, s)
    for name in ("alpha", "bravo"):
        with pytest.raises(VaultCorrupt) as ei:
            v.get(name)
        assert ei.value.code == "vault.corrupt"
        assert name in ei.value.message


def test_entry_copied_to_a_new_name_fails(v):
    v.set("alpha", "secret")
    s = load_store(v)
    s["mallory"] = dict(s["alpha"])
    save_store(v, s)
    with pytest.raises(VaultCorrupt):
        v.get("mallory")
    assert v.get("alpha") == "secret"


@pytest.mark.parametrize("field", ["ct", "nonce"])
def test_tampered_entry(v, field):
    v.set("a", "secret")
    s = load_store(v)
    raw = bytearray(base64.b64decode(s["a"][field]))
    raw[0] ^= 1
    s["a"][field] = base64.b64encode(bytes(raw)).decode()
    save_store(v, s)
    with pytest.raises(VaultCorrupt):
        v.get("a")


@pytest.mark.parametrize("entry, listable", [
    ({"nonce": "!!!", "ct": "AAAA", "created": 1, "updated": 1}, True),
    ({"nonce": "AAAA", "ct": "AAAA", "created": 1, "updated": 1}, True),
    ("a string", False),
    ({"ct": "AAAA"}, False),
    ({"nonce": "AAAA", "ct": "AAAA", "created": "yesterday", "updated": 1}, False),
])
def test_malformed_entries(v, entry, listable):
    v.set("a", "secret")
    s = load_store(v)
    s["a"] = entry
    save_store(v, s)
    with pytest.raises(VaultCorrupt):
        v.get("a")
    if listable:  # list() does not decrypt
        assert [i.name for i in v.list()] == ["a"]
    else:
        with pytest.raises(VaultCorrupt):
            v.list()


@pytest.mark.parametrize("text", ["{not json", "[]", "\xff"])
def test_unparsable_store(v, text):
    v.set("a", "secret")
    v.store_path.write_bytes(text.encode("latin-1"))
    with pytest.raises(VaultCorrupt):
        v.get("a")


def test_wrong_key_fails(v):
    v.set("a", "secret")
    v.key_path.write_bytes(os.urandom(32))
    with pytest.raises(VaultCorrupt):
        v.get("a")


# ------------------------------------------------------------------------------ concurrency
def _setter(directory: str, prefix: str, n: int) -> None:
    vv = Vault(Path(directory))
    for i in range(n):
        vv.set(f"{prefix}{i}", f"{prefix}-value-{i}")


def test_concurrent_set_from_two_processes_keeps_both(vdir):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_setter, args=(str(vdir), p, 25)) for p in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    v = Vault(vdir)
    names = {i.name for i in v.list()}
    assert names == {f"{p}{i}" for p in "ab" for i in range(25)}
    for p in "ab":
        for i in range(25):
            assert v.get(f"{p}{i}") == f"{p}-value-{i}"


# ------------------------------------------------------------------------------ revocation
def test_revocation_global_vs_sandbox(v):
    v.set("tok", "x")
    v.set("other", "y")
    assert not v.is_revoked("tok") and not v.is_revoked("tok", "sb1")
    assert v.revoke("tok", "sb1") is True
    assert v.revoke("tok", "sb1") is False
    assert v.is_revoked("tok", "sb1")
    assert not v.is_revoked("tok", "sb2") and not v.is_revoked("tok")
    assert not v.is_revoked("other", "sb1")
    assert v.revoke("tok") is True
    assert v.is_revoked("tok") and v.is_revoked("tok", "sb2")
    [other, tok] = v.list()
    assert tok.revoked and tok.revoked_sandboxes == ("sb1",) and not other.revoked
    assert v.restore("tok") is True
    assert v.restore("tok") is False
    assert not v.is_revoked("tok") and v.is_revoked("tok", "sb1")  # scopes are independent
    assert v.restore("tok", "sb1") is True
    assert not v.is_revoked("tok", "sb1")
    assert json.loads(v.revocations_path.read_text()) == {"global": {}, "sandboxes": {}}
    assert v.get("tok") == "x"  # revocation does not delete


def test_remove_clears_revocations(v):
    v.set("tok", "x")
    v.revoke("tok")
    v.revoke("tok", "sb")
    v.remove("tok")
    assert not v.is_revoked("tok") and not v.is_revoked("tok", "sb")
    v.set("tok", "new")
    assert not v.is_revoked("tok", "sb")


def test_is_revoked_sees_other_instance_immediately(vdir):
    gate = Vault(vdir)
    op = Vault(vdir)
    op.set("tok", "x")
    for i in range(200):  # many writes within the same clock tick, same file sizes
        sb = f"sb{i % 2}"
        assert not gate.is_revoked("tok", sb)
        op.revoke("tok", sb)
        assert gate.is_revoked("tok", sb)
        op.restore("tok", sb)
        assert not gate.is_revoked("tok", sb)


def test_is_revoked_sees_other_process_immediately(vdir, monkeypatch):
    gate = Vault(vdir)
    gate.set("tok", "x")
    assert not gate.is_revoked("tok")
    env = dict(os.environ, AGENTVM_HOME=str(vdir.parent))
    r = subprocess.run([sys.executable, "-m", "agentvm", "secret", "revoke", "tok"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert gate.is_revoked("tok")
    subprocess.run([sys.executable, "-m", "agentvm", "secret", "restore", "tok"], env=env, check=True,
                   capture_output=True)
    assert not gate.is_revoked("tok")


def test_is_revoked_uses_one_stat_and_caches_parse(v, monkeypatch):
    v.set("tok", "x")
    v.revoke("tok", "sb")
    assert v.is_revoked("tok", "sb")
    stats, reads = [], []
    real_stat, real_read = os.stat, Vault._read_json
    monkeypatch.setattr(vault_mod.os, "stat", lambda *a, **k: stats.append(a) or real_stat(*a, **k))
    monkeypatch.setattr(Vault, "_read_json", lambda self, *a: reads.append(a) or real_read(self, *a))
    for _ in range(10):
        assert v.is_revoked("tok", "sb")
    assert len(stats) == 10 and reads == []


def test_is_revoked_without_vault(v):
    assert v.is_revoked("anything") is False
    assert not v.directory.exists()


def test_signature_changes_even_when_the_clock_stands_still(v, monkeypatch):
    v.set("tok", "x")
    monkeypatch.setattr(vault_mod.time, "time_ns", lambda: 1_000_000_000)
    monkeypatch.setattr(vault_mod.time, "time", lambda: 1.0)
    gate = Vault(v.directory)
    seen = set()
    for sb in ("s1", "s2", "s1", "s2"):
        v.revoke("tok", sb)
        st = os.stat(v.revocations_path)
        seen.add((st.st_mtime_ns, st.st_size, st.st_ino))
        assert gate.is_revoked("tok", sb)
        v.restore("tok", sb)
        assert not gate.is_revoked("tok", sb)
    assert len(seen) == 4


def test_version_and_changed_since(v):
    assert v.version() is None
    changed, tok = v.changed_since(None)
    assert not changed
    v.set("a", "1")
    changed, tok = v.changed_since(tok)
    assert changed
    assert v.changed_since(tok) == (False, tok)
    v.revoke("a")
    assert v.changed_since(tok)[0] is False  # revocations live elsewhere
    v.set("a", "2")  # rotation
    changed, tok = v.changed_since(tok)
    assert changed
    v.remove("a")
    assert v.changed_since(tok)[0]


# ------------------------------------------------------------------------------ references
def test_resolve_vault(v):
    v.set("tok", "from-vault")
    assert v.resolve("vault:tok") == "from-vault"
    with pytest.raises(SecretNotFound) as ei:
        v.resolve("vault:missing")
    assert "missing" in ei.value.message
    with pytest.raises(InvalidReference):
        v.resolve("vault:bad/name")


def test_resolve_env(v):
    assert v.resolve("env:TOK", environ={"TOK": "from-env"}) == "from-env"
    with pytest.raises(UnresolvedReference) as ei:
        v.resolve("env:TOK", environ={})
    assert "env:TOK" in ei.value.message and "not set" in ei.value.message
    with pytest.raises(UnresolvedReference) as ei:
        v.resolve("env:TOK", environ={"TOK": ""})
    assert "empty" in ei.value.message
    with pytest.raises(InvalidReference):
        v.resolve("env:1BAD", environ={})
    assert v.resolve("env:HOME") == os.environ["HOME"]  # defaults to os.environ


def test_resolve_file(v, tmp_path):
    f = tmp_path / "tok"
    f.write_text("from-file\n")
    assert v.resolve(f"file:{f}") == "from-file"
    f.write_text("two\n\n")
    assert v.resolve(f"file:{f}") == "two\n"  # ONE newline stripped
    f.write_text("crlf\r\n")
    assert v.resolve(f"file:{f}") == "crlf"
    f.write_text("none")
    assert v.resolve(f"file:{f}") == "none"
    f.write_text("x" * MAX_VALUE_BYTES + "\n")
    assert len(v.resolve(f"file:{f}")) == MAX_VALUE_BYTES
    link = tmp_path / "link"
    link.symlink_to(f)  # e.g. Kubernetes secret mounts
    assert v.resolve(f"file:{link}") == "x" * MAX_VALUE_BYTES


def test_resolve_file_errors(v, tmp_path):
    cases = {}
    cases["missing"] = tmp_path / "missing"
    cases["dir"] = tmp_path
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases["fifo"] = fifo  # must not block
    big = tmp_path / "big"
    big.write_text("x" * (MAX_VALUE_BYTES + 1))
    cases["big"] = big
    empty = tmp_path / "empty"
    empty.write_text("\n")
    cases["empty"] = empty
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe")
    cases["binary"] = binary
    for what, path in cases.items():
        with pytest.raises(UnresolvedReference) as ei:
            v.resolve(f"file:{path}")
        assert f"file:{path}" in ei.value.message, what
    with pytest.raises(InvalidReference):
        v.resolve("file:relative/path")


@pytest.mark.parametrize("ref", ["", "plain", "http://x", "vault", "vault:", "env:", "file:", ":x", 5])
def test_resolve_invalid(v, ref):
    with pytest.raises(InvalidReference) as ei:
        v.resolve(ref)
    assert ei.value.code == "vault.ref-invalid"


# ------------------------------------------------------------------------------ the canary
def _errors_with_canary(v: Vault, tmp_path: Path) -> list[AgentVMError]:
    """Provoke every error path while the canary is stored, in the environment and on disk."""
    errs: list[AgentVMError] = []

    def expect(fn):
        try:
            fn()
        except AgentVMError as e:
            errs.append(e)
        else:  # pragma: no cover
            raise AssertionError("expected an error")

    canary_file = tmp_path / "canary"
    canary_file.write_text(CANARY + "\x00")
    env = {"C": CANARY + "\x00", "E": ""}
    expect(lambda: v.set("x", CANARY + "\x00"))
    expect(lambda: v.set("x", CANARY * 3000))
    expect(lambda: v.set(CANARY + "/", "v"))  # a value typed where the name belongs
    expect(lambda: v.set(CANARY * 3, "v"))
    expect(lambda: v.get(CANARY + "!"))
    expect(lambda: v.resolve(CANARY))  # a value pasted where a reference belongs
    expect(lambda: v.resolve("Bearer:" + CANARY))
    expect(lambda: v.resolve("vault:" + CANARY + "+/"))
    expect(lambda: v.resolve("env:C", environ=env))
    expect(lambda: v.resolve("env:E", environ=env))
    expect(lambda: v.resolve(f"file:{canary_file}"))
    big = tmp_path / "big"
    big.write_text(CANARY * 3000)
    expect(lambda: v.resolve(f"file:{big}"))
    # tampering with the stored canary
    s = load_store(v)
    s["other"] = s["canary"]
    save_store(v, s)
    expect(lambda: v.get("other"))
    os.chmod(v.key_path, 0o644)
    expect(lambda: v.get("canary"))
    os.chmod(v.key_path, 0o600)
    return errs


def test_canary_never_leaks(v, tmp_path):
    v.set("canary", CANARY)
    v.revoke("canary", "sb")
    assert v.get("canary") == CANARY
    assert v.resolve("vault:canary") == CANARY
    # nothing on disk holds the plaintext
    for p in v.directory.iterdir():
        data = p.read_bytes()
        assert CANARY.encode() not in data, p
        assert base64.b64encode(CANARY.encode()) not in data, p
    # reprs of everything returned
    objs = [v, v.list(), *v.list(), v.version(), v.changed_since(None), v.is_revoked("canary", "sb")]
    texts = [repr(o) for o in objs] + [str(o) for o in objs] + [json.dumps([i.to_dict() for i in v.list()])]
    errs = _errors_with_canary(v, tmp_path)
    assert len(errs) == 14
    for e in errs:
        texts += [str(e), repr(e), e.message, e.hint, json.dumps(e.to_dict()), repr(e.args)]
        # chained causes would show in a traceback
        c = e.__cause__ or e.__context__
        while c is not None:
            texts += [str(c), repr(c)]
            c = c.__cause__ or c.__context__
    for t in texts:
        assert CANARY not in t, t
    assert v.get("canary") == CANARY  # still intact


def test_any_revoked_is_is_revoked_of_any_name(v):
    import itertools

    v.set("tok", "x")
    v.set("g", "y")
    v.revoke("tok", "sb1")
    v.revoke("g")
    names = ("tok", "g", "nope")
    for combo in itertools.chain.from_iterable(itertools.combinations(names, k) for k in range(4)):
        for sb in (None, "sb1", "sb2"):
            assert v.any_revoked(combo, sb) == any(v.is_revoked(n, sb) for n in combo), (combo, sb)
