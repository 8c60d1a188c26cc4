"""Two ``rt.run`` calls in threads of one process build the sandbox /etc view at the same time:
each builds its own temporary copy (its name unique per call: pid, thread and random), the first
rename wins, and neither fails (it used to be ``.etc-view-<hash>-<pid>`` for both: one thread
removed or collided with the other's copy - FileExistsError)."""

from __future__ import annotations

import threading
from pathlib import Path

from agentvm.backends import hostview as hv


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "etc" / "ssl").mkdir(parents=True)
    (root / "etc" / "ssl" / "openssl.cnf").write_text("# allowlisted\n")
    (root / "etc" / "hostname").write_text("h\n")
    (root / "usr").mkdir()
    return root


def test_two_threads_building_the_same_view_at_once_both_get_it(tmp_path, monkeypatch):
    root, runtime = _root(tmp_path), tmp_path / "runtime"
    hv._VIEW_CACHE.clear()
    both_copying = threading.Barrier(2, timeout=20)
    tmps: list[Path] = []
    real_run = hv._EtcCopy.run

    def run(self, names):
        tmps.append(self.tmp)
        both_copying.wait()  # both threads are inside the copy at once: the race, every time
        return real_run(self, names)

    monkeypatch.setattr(hv._EtcCopy, "run", run)
    results: list[Path] = []
    errors: list[BaseException] = []

    def go():
        try:
            results.append(hv.etc_view(runtime, root=str(root)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert len(results) == 2 and results[0] == results[1], results
    view = results[0]
    assert (view / "ssl" / "openssl.cnf").read_text() == "# allowlisted\n"
    assert (view / "passwd").is_file(), "the view is whole (the synthetic files were written)"
    assert len(tmps) == 2 and tmps[0] != tmps[1], ("each call builds its own copy", tmps)
    assert not list(runtime.glob(".etc-view-*")), "the losing copy is removed"
    hv._VIEW_CACHE.clear()
