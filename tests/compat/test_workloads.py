"""Software that agents run works unchanged inside the default sandbox: a web app's tests on an
ephemeral loopback port, a Node server and its test, a parallel C build, SQLite in WAL mode,
multiprocessing with every start method (and a manager over TCP), POSIX shared memory.

Each test runs the real thing in a real sandbox and checks its own output, not ours."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import needs_root

pytestmark = [pytest.mark.integration, needs_root]


def _ok(r, *needles: str):
    out = r.stdout if isinstance(r.stdout, str) else r.stdout.decode(errors="replace")
    err = r.stderr if isinstance(r.stderr, str) else r.stderr.decode(errors="replace")
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
    for n in needles:
        assert n in out, f"{n!r} not in output\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"


def test_a_flask_app_tested_over_http_on_an_ephemeral_port(py):
    """The pattern of most web test suites: start the app on port 0, hit it with requests."""
    code = textwrap.dedent("""
        import threading, requests
        from flask import Flask, jsonify, request
        from werkzeug.serving import make_server
        app = Flask("t")
        @app.post("/items")
        def add():
            return jsonify(got=request.json["name"]), 201
        srv = make_server("127.0.0.1", 0, app)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        r = requests.post("http://127.0.0.1:%d/items" % srv.server_port, json={"name": "x"}, timeout=5)
        assert r.status_code == 201 and r.json() == {"got": "x"}, (r.status_code, r.text)
        # "localhost" too: the name resolves inside, and NO_PROXY keeps it off the gate
        r = requests.post("http://localhost:%d/items" % srv.server_port, json={"name": "y"}, timeout=5)
        assert r.json() == {"got": "y"}
        srv.shutdown()
        print("FLASK OK")
    """)
    _ok(py(code), "FLASK OK")


def test_python_http_server_module(sh):
    _ok(sh("cd /tmp && echo hello > f.txt && (python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &) && "
           "for i in $(seq 50); do curl -sf http://127.0.0.1:8000/f.txt && break; sleep 0.1; done"), "hello")


def test_a_node_http_server_and_its_node_test(sh):
    script = textwrap.dedent("""
        cat > /tmp/server.test.js <<'EOF'
        const test = require('node:test');
        const assert = require('node:assert');
        const http = require('node:http');
        test('server answers on an ephemeral port', async () => {
          const srv = http.createServer((req, res) => res.end('hi ' + req.url));
          await new Promise(r => srv.listen(0, '127.0.0.1', r));
          const { port } = srv.address();
          const body = await new Promise((resolve, reject) => {
            http.get({ host: '127.0.0.1', port, path: '/x' }, res => {
              let b = ''; res.on('data', d => b += d); res.on('end', () => resolve(b));
            }).on('error', reject);
          });
          assert.strictEqual(body, 'hi /x');
          srv.close();
        });
        EOF
        cd /tmp && node --test server.test.js
    """)
    _ok(sh(script), "pass 1")


def test_a_parallel_c_build_with_make(sh):
    script = textwrap.dedent("""
        set -e
        mkdir -p /tmp/proj && cd /tmp/proj
        for i in 1 2 3 4; do printf 'int f%d(void){return %d;}\\n' $i $i > f$i.c; done
        printf 'int f1(void);int f2(void);int f3(void);int f4(void);\\nint main(void){return f1()+f2()+f3()+f4()-10;}\\n' > main.c
        printf 'OBJS=main.o f1.o f2.o f3.o f4.o\\napp: $(OBJS)\\n\\t$(CC) -o $@ $(OBJS)\\n%%.o: %%.c\\n\\t$(CC) -O2 -c $<\\n' > Makefile
        make -j2 -s && ./app && echo BUILD OK
    """)
    _ok(sh(script), "BUILD OK")


def test_sqlite_in_wal_mode_with_concurrent_writers(py):
    code = textwrap.dedent("""
        import sqlite3, multiprocessing as mp
        DB = "/tmp/t.db"
        c = sqlite3.connect(DB); c.execute("pragma journal_mode=wal"); c.execute("create table t(x)"); c.commit(); c.close()
        def w(n):
            c = sqlite3.connect(DB, timeout=30)
            for i in range(200):
                c.execute("insert into t values (?)", (n,)); c.commit()
            c.close()
        ps = [mp.Process(target=w, args=(n,)) for n in range(4)]
        [p.start() for p in ps]; [p.join() for p in ps]
        c = sqlite3.connect(DB)
        print("MODE", c.execute("pragma journal_mode").fetchone()[0], "ROWS", c.execute("select count(*) from t").fetchone()[0])
    """)
    _ok(py(code), "MODE wal ROWS 800")


def test_multiprocessing_with_every_start_method_and_a_tcp_manager(sh):
    code = textwrap.dedent("""
        import multiprocessing as mp
        from multiprocessing.managers import BaseManager
        def sq(x):
            return x * x
        class M(BaseManager):
            pass
        if __name__ == "__main__":
            for method in ("fork", "spawn", "forkserver"):
                with mp.get_context(method).Pool(2) as p:
                    assert p.map(sq, range(10)) == [x * x for x in range(10)], method
                print("POOL", method, "OK")
            M.register("store", callable=dict)
            with M(address=("127.0.0.1", 0), authkey=b"k") as m:  # a manager over loopback TCP
                d = m.store(); d.update(a=1)
                print("MANAGER", m.address[0], d.get("a"))
            lock = mp.Lock(); q = mp.Queue(); q.put(1); assert q.get() == 1
            print("SYNC OK")
    """)
    # spawn and forkserver re-import __main__: run it from a file, as a real program is
    _ok(sh("cat > /tmp/m.py <<'EOF'\n" + code + "\nEOF\npython3 /tmp/m.py"),
        "POOL fork OK", "POOL spawn OK", "POOL forkserver OK", "MANAGER 127.0.0.1 1", "SYNC OK")


def test_posix_shared_memory_in_dev_shm(py):
    code = textwrap.dedent("""
        from multiprocessing import shared_memory
        import os
        s = shared_memory.SharedMemory(create=True, size=8 * 1024 * 1024)
        s.buf[:5] = b"hello"
        t = shared_memory.SharedMemory(name=s.name)
        print("SHM", bytes(t.buf[:5]).decode(), os.path.exists("/dev/shm/" + s.name))
        t.close(); s.close(); s.unlink()
    """)
    _ok(py(code), "SHM hello True")


def test_a_workload_over_its_limits_is_told_which_limit_to_raise(agentvm):
    r = agentvm("run", "--memory", "128M", "--", "/usr/bin/python3", "-c", "b = bytearray(512 * 1024 * 1024); print(len(b))")
    err = r.stderr.decode()
    assert r.returncode != 0 and "memory limit (128M) was hit" in err and "--memory 2G" in err, err
    threads = ("import threading, time\nts = [threading.Thread(target=time.sleep, args=(3,)) for _ in range(400)]\n"
               "[t.start() for t in ts]\n")
    r = agentvm("run", "--", "/usr/bin/python3", "-c", threads)
    err = r.stderr.decode()
    assert "task limit (256) was hit" in err and "limits.pids" in err, err
