"""Brokered credentials end to end: real clients inside real sandboxes hold placeholders; the
gate mints the real, short-lived credential from a long-lived one in the vault - at an Authlib
OAuth 2 server, at moto's STS, at a GitHub-shaped app-token endpoint - and swaps it in or signs
with it. The agent attacks: it asks an upstream to echo what it got, asks the token endpoint
itself, and the operator revokes mid-session; neither the long-lived secret nor the minted
value reaches the sandbox, the decision log or the audit."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import agentvm_cmd, last_json, needs_root
from tests.unit.test_brokers_peers import (Moto, TlsFront, _Thread, github_entry, github_server, oauth_entry,
                                           oauth_server)

pytestmark = [pytest.mark.integration, needs_root]

TESTLIB = Path(os.environ.get("AGENTVM_TESTLIB", "/opt/agentvm/testlib"))
AKID = "AKIAPLACEHOLDER0042"


def _secret_set(name: str, value: str) -> None:
    r = subprocess.run(agentvm_cmd() + ["secret", "set", name], input=value.encode(), capture_output=True)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def world(tmp_path_factory, avm_home):
    from tests.integration.gate_upstreams import make_test_ca

    d = Path(f"/tmp/agentvm-test-brokers-{secrets.token_hex(3)}")
    d.mkdir(mode=0o755)
    ca, cert, key = make_test_ca(d / "ca")
    stops = []
    try:
        ost, osrv = oauth_server()  # the token endpoint the gate uses (loopback http)
        stops.append(osrv.stop)
        o_tls = _Thread(osrv.app, tls=(cert, key))  # the same server as api.test / other.test (https)
        stops.append(o_tls.stop)
        gst, gsrv = github_server()
        stops.append(gsrv.stop)
        g_tls = _Thread(gsrv.app, tls=(cert, key))
        stops.append(g_tls.stop)
        moto = Moto(Moto.SETUP_ACTIONS)
        stops.append(moto.stop)
        aws = moto.setup()
        front = TlsFront(cert, key, moto.port)
        stops.append(front.stop)
        _secret_set("api-oauth", json.dumps(oauth_entry(ost, osrv.port)))
        _secret_set("gh-app", json.dumps(github_entry(gst, gsrv.port)))
        _secret_set("aws-root", json.dumps({k: aws[k] for k in ("accessKeyId", "secretAccessKey", "region", "endpoint")}))
        agent = d / "brokers.yaml"
        agent.write_text(textwrap.dedent(f"""\
            apiVersion: agentvm/v1
            kind: Agent
            metadata: {{name: brokers-e2e}}
            spec:
              riskTier: L3
              limits: {{timeout: 120s, memory: 1G}}
              mounts: [{{host: {TESTLIB}, path: /opt/testlib}}]
              env: {{PYTHONPATH: /opt/testlib, AWS_EC2_METADATA_DISABLED: "true"}}
              egress:
                hosts: {{api.test: 127.0.0.1, other.test: 127.0.0.1, git.test: 127.0.0.1, s3.test: 127.0.0.1}}
                upstreamCa: {ca}
                allow:
                  - {{host: api.test, ports: [{o_tls.port}]}}
                  - {{host: other.test, ports: [{o_tls.port}]}}
                  - {{host: git.test, ports: [{g_tls.port}]}}
                  - {{host: s3.test, ports: [{front.port}]}}
              credentials:
                - name: api
                  env: API_TOKEN
                  ref: vault:api-oauth
                  hosts: [api.test]
                  inject: {{header: Authorization, format: "Bearer {{}}"}}
                  broker: {{kind: oauth2-refresh, scopes: [read]}}
                - name: gh
                  env: GH_TOKEN
                  ref: vault:gh-app
                  hosts: [git.test]
                  inject: {{header: Authorization, format: "token {{}}"}}
                  broker: {{kind: github-app, repositories: [widgets], permissions: {{contents: read}}}}
                - name: aws
                  env: AWS_SECRET_ACCESS_KEY
                  ref: vault:aws-root
                  hosts: [s3.test]
                  sigv4: {{accessKeyId: {AKID}}}
                  broker: {{kind: aws-sts, roleArn: "{aws['roleArn']}", durationSeconds: 900}}
            """))
        yield {"dir": d, "agent": agent, "oauth": ost, "api_port": o_tls.port, "gh": gst, "gh_port": g_tls.port,
               "aws": aws, "s3_port": front.port, "home": avm_home}
    finally:
        for stop in reversed(stops):
            try:
                stop()
            except Exception:
                pass
        shutil.rmtree(d, ignore_errors=True)


def run_py(world, code: str, *, timeout: float = 150):
    r = subprocess.run(agentvm_cmd() + ["run", "-f", str(world["agent"]), "--json", "--", "python3", "-c", code],
                       capture_output=True, timeout=timeout)
    return r, last_json(r.stdout)


def log_lines(res: dict) -> list[dict]:
    return [json.loads(ln) for ln in Path(res["egress"]["log"]).read_text().splitlines()]


def _secrets_of(world) -> list[str]:
    """Every long-lived and every minted value the peers know of."""
    o, g = world["oauth"], world["gh"]
    return ([o.client_secret] + list(o.refresh_tokens) + list(o.access_tokens) + list(g.issued)
            + [world["aws"]["secretAccessKey"]])


def _assert_nowhere(world, out: str, res: dict) -> None:
    vals = _secrets_of(world)
    assert not [v for v in vals if v in out], "a real value reached the sandbox"
    log = Path(res["egress"]["log"]).read_text()
    assert not [v for v in vals if v in log], "a real value is in the decision log"
    # nothing under the installation's state (audit chain, run records, traces) holds one in clear
    hits = []
    for p in Path(world["home"]).rglob("*"):
        if p.is_file() and p.stat().st_size < 20 << 20:
            data = p.read_bytes()
            hits += [str(p) for v in vals if v.encode() in data]
    assert not hits, hits


def test_oauth2_the_sandbox_calls_the_api_with_a_minted_token_and_never_sees_it(world):
    p = world["api_port"]
    code = textwrap.dedent(f"""
        import os, base64, requests
        ph = os.environ["API_TOKEN"]
        r = requests.get("https://api.test:{p}/api/me", headers={{"Authorization": "Bearer " + ph}})
        print("ME", r.status_code, r.json().get("scope"))
        e = requests.get("https://api.test:{p}/api/echo", headers={{"Authorization": "Bearer " + ph}}).json()
        print("ECHO", e["authorization"] == "Bearer " + ph, base64.b64decode(e["b64"]).decode() == "Bearer " + ph)
        print(e)
    """)
    grants = world["oauth"].grants
    r, res = run_py(world, code)
    out = r.stdout.decode()
    assert r.returncode == 0 and "ME 200 read" in out, out + r.stderr.decode()[-3000:]
    assert "ECHO True True" in out, "the echo came back as the placeholder (raw and base64)"
    assert world["oauth"].grants == grants + 1, "one refresh grant for the session's requests"
    minted = [a for a in world["oauth"].seen_by_resource if a.startswith("Bearer fake-access-")]
    assert minted, "the resource server saw a minted access token"
    _assert_nowhere(world, out + r.stderr.decode(), res)
    assert any(ln.get("credentials") == ["api"] for ln in log_lines(res))


def test_oauth2_the_minted_token_is_revoked_at_the_server_when_the_session_ends(world):
    """The gate mints at attach (off its loop) and, when the endpoint closes, revokes what it
    minted (RFC 7009): once ``agentvm run`` has returned, the token server has the revocation."""
    p = world["api_port"]
    code = textwrap.dedent(f"""
        import os, requests
        r = requests.get("https://api.test:{p}/api/me", headers={{"Authorization": "Bearer " + os.environ["API_TOKEN"]}})
        print("ME", r.status_code)
    """)
    before = len(world["oauth"].seen_by_resource)
    r, res = run_py(world, code)
    out = r.stdout.decode()
    assert r.returncode == 0 and "ME 200" in out, out + r.stderr.decode()[-3000:]
    used = [a[7:] for a in world["oauth"].seen_by_resource[before:] if a.startswith("Bearer fake-access-")]
    assert used, "the resource server saw a minted access token"
    assert used[-1] in world["oauth"].revocations, "the session's minted token was revoked when the session ended"


def test_oauth2_revoked_at_session_end_when_a_gate_worker_serves_the_sandbox(world):
    """The same through the daemon with a gate worker: the worker's gate mints at attach and
    revokes when the daemon closes the endpoint (the worker path of the endpoint lifecycle)."""
    from tests.integration.test_daemon import daemon_up

    p = world["api_port"]
    code = textwrap.dedent(f"""
        import os, requests
        r = requests.get("https://api.test:{p}/api/me", headers={{"Authorization": "Bearer " + os.environ["API_TOKEN"]}})
        print("ME", r.status_code)
    """)
    def in_daemon() -> int:  # sandboxes the daemon kept on its own gate (not placeable on a worker)
        r = subprocess.run(agentvm_cmd() + ["audit", "export", "--what", "audit", "--format", "json"],
                           capture_output=True, text=True, timeout=60)
        return sum(1 for ln in r.stdout.splitlines() if '"gate.placement"' in ln)

    with daemon_up(Path(world["home"]), "--gate-workers", "1"):
        before, placed = len(world["oauth"].seen_by_resource), in_daemon()
        r, res = run_py(world, code)
        assert in_daemon() == placed, "the sandbox was served by a gate worker"
        out = r.stdout.decode()
        assert r.returncode == 0 and "ME 200" in out, out + r.stderr.decode()[-3000:]
        used = [a[7:] for a in world["oauth"].seen_by_resource[before:] if a.startswith("Bearer fake-access-")]
        assert used, "the resource server saw a minted access token"
        deadline = time.time() + 10
        while used[-1] not in world["oauth"].revocations and time.time() < deadline:
            time.sleep(0.05)
        assert used[-1] in world["oauth"].revocations, "the worker revoked the session's token when its endpoint closed"


def test_oauth2_the_agent_asks_the_token_endpoint_itself(world):
    p = world["api_port"]
    code = textwrap.dedent(f"""
        import os, requests
        ph = os.environ["API_TOKEN"]
        for how, kw in [("body", dict(data={{"grant_type": "refresh_token", "refresh_token": ph}})),
                        ("header", dict(data={{"grant_type": "refresh_token"}}, headers={{"Authorization": "Bearer " + ph}}))]:
            r = requests.post("https://other.test:{p}/token", **kw)
            print("TOKEN", how, r.status_code, r.headers.get("X-Agentvm-Denied"), "access_token" in r.text)
    """)
    grants = world["oauth"].grants
    r, res = run_py(world, code)
    out = r.stdout.decode()
    assert "TOKEN body 403" in out and "TOKEN header 403" in out, out + r.stderr.decode()[-2000:]
    assert "True" not in out
    denials = [ln for ln in log_lines(res) if ln["verdict"] == "deny"]
    assert len(denials) == 2 and all(d["rule"] == "credential:leak:api" and d.get("alert") for d in denials)
    assert world["oauth"].grants == grants + 1, "only the gate's own mint at attach, none from the agent's attempts"
    _assert_nowhere(world, out, res)


def test_oauth2_revoked_mid_session_is_denied_and_revoked_at_the_server(world):
    p = world["api_port"]
    flag = world["dir"] / "revoked"
    code = textwrap.dedent(f"""
        import os, time, requests
        ph = os.environ["API_TOKEN"]
        u = "https://api.test:{p}/api/me"
        print("BEFORE", requests.get(u, headers={{"Authorization": "Bearer " + ph}}).status_code, flush=True)
        print("WAIT", flush=True)
        input()
        r = requests.get(u, headers={{"Authorization": "Bearer " + ph}})
        print("AFTER", r.status_code, r.headers.get("X-Agentvm-Denied"), flush=True)
    """)
    proc = subprocess.Popen(agentvm_cmd() + ["run", "-f", str(world["agent"]), "--", "python3", "-c", code],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline().startswith(b"BEFORE 200"), proc.stderr.read1().decode()[-2000:]
        assert proc.stdout.readline().startswith(b"WAIT")
        used = [a[7:] for a in world["oauth"].seen_by_resource if a.startswith("Bearer fake-access-")][-1]
        r = subprocess.run(agentvm_cmd() + ["secret", "revoke", "api-oauth"], capture_output=True)
        assert r.returncode == 0, r.stderr
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        after = proc.stdout.readline().decode()
        assert after.startswith("AFTER 403 credential:revoked:api"), after
        deadline = time.time() + 10
        while used not in world["oauth"].revocations and time.time() < deadline:
            time.sleep(0.05)
        assert used in world["oauth"].revocations, "the minted token was revoked at the server (RFC 7009)"
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(agentvm_cmd() + ["secret", "restore", "api-oauth"], capture_output=True)


def test_oauth2_a_refused_refresh_is_a_clear_denial(world):
    world["oauth"].fail_next = "invalid_grant"
    code = textwrap.dedent(f"""
        import os, requests
        r = requests.get("https://api.test:{world['api_port']}/api/me", headers={{"Authorization": "Bearer " + os.environ["API_TOKEN"]}})
        print("STATUS", r.status_code, r.headers.get("X-Agentvm-Denied"))
        print(r.text[:400])
    """)
    r, res = run_py(world, code)
    out = r.stdout.decode()
    assert "STATUS 403 credential:unavailable" in out, out + r.stderr.decode()[-2000:]
    denial = [ln for ln in log_lines(res) if ln["verdict"] == "deny"][0]
    assert "invalid_grant" in denial["reason"] and denial.get("credential") == "api"
    _assert_nowhere(world, out, res)


def test_github_app_installation_token_limited_to_the_named_repository(world):
    p = world["gh_port"]
    code = textwrap.dedent(f"""
        import os, requests
        h = {{"Authorization": "token " + os.environ["GH_TOKEN"]}}
        print("WIDGETS", requests.get("https://git.test:{p}/repos/o/widgets", headers=h).status_code)
        print("OTHER", requests.get("https://git.test:{p}/repos/o/payroll", headers=h).status_code)
    """)
    r, res = run_py(world, code)
    out = r.stdout.decode()
    assert "WIDGETS 200" in out and "OTHER 404" in out, out + r.stderr.decode()[-2000:]
    toks = list(world["gh"].issued)
    assert toks and world["gh"].issued[toks[-1]]["permissions"] == {"contents": "read"}
    _assert_nowhere(world, out, res)


@pytest.mark.parametrize("client", ["boto3", "awscli"])
def test_aws_sts_a_real_client_in_the_sandbox_is_signed_with_session_credentials(world, client):
    p = world["s3_port"]
    if client == "boto3":
        code = textwrap.dedent(f"""
            import os, boto3
            from botocore.config import Config
            s3 = boto3.client("s3", endpoint_url="https://s3.test:{p}", region_name="us-east-1",
                              config=Config(s3={{"addressing_style": "path"}}, retries={{"max_attempts": 1}}))
            s3.put_object(Bucket="agent-bucket", Key="hello.txt", Body=b"hi from the sandbox")
            print("KEYS", [o["Key"] for o in s3.list_objects_v2(Bucket="agent-bucket").get("Contents", [])])
        """)
        r, res = run_py(world, code)
    else:
        if not shutil.which("aws", path="/usr/bin"):
            pytest.fail("Debian's awscli is missing: run `bash scripts/install.sh --test`")
        script = (f"unset PYTHONPATH; /usr/bin/aws --endpoint-url https://s3.test:{p} --region us-east-1 s3api put-object --bucket agent-bucket "
                  f"--key cli.txt --body /etc/hostname >/dev/null && /usr/bin/aws --endpoint-url https://s3.test:{p} "
                  "--region us-east-1 s3api list-objects-v2 --bucket agent-bucket --query 'Contents[].Key' --output text "
                  "| sed 's/^/KEYS /'")
        r = subprocess.run(agentvm_cmd() + ["run", "-f", str(world["agent"]), "--json", "--", "bash", "-c", script],
                           capture_output=True, timeout=150)
        res = last_json(r.stdout)
    out = r.stdout.decode()
    assert r.returncode == 0 and "KEYS" in out, out + r.stderr.decode()[-3000:]
    assert ("hello.txt" if client == "boto3" else "cli.txt") in out
    # moto checks every signature: it accepted them only as an assumed-role session's
    lines = [ln for ln in log_lines(res) if ln.get("credentials") == ["aws"]]
    assert lines and all(ln["verdict"] == "allow" for ln in lines)
    _assert_nowhere(world, out, res)


# -- the shipped examples (examples/credentials/KIND/run.sh) ----------------------------------
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "credentials"


def _example(kind: str) -> str:
    import sys

    env = dict(os.environ, AGENTVM=f"{sys.executable} -m agentvm", AGENTVM_PYTHON=sys.executable)
    r = subprocess.run(["bash", str(EXAMPLES / kind / "run.sh")], capture_output=True, env=env, timeout=300)
    out = r.stdout.decode()
    assert r.returncode == 0, out + r.stderr.decode()[-3000:]
    return out


def test_credentials_example_oauth2_refresh(avm_home):
    out = _example("oauth2-refresh")
    assert "(a placeholder)" in out and "/api/me -> 200" in out and "echoed back the placeholder" in out
    assert out.splitlines()[-1] == ("upstream saw: 2 request(s) with access token(s) minted by the gate's refresh grant "
                                    "(valid), never the refresh token")


def test_credentials_example_github_app(avm_home):
    out = _example("github-app")
    assert "demo/widgets -> 200 ; demo/payroll -> 404" in out
    assert out.splitlines()[-1].startswith('upstream saw: 2 request(s) with installation token(s) limited to ["widgets"]')


def test_credentials_example_aws_sts(avm_home):
    if not Path("/usr/bin/aws").exists():
        pytest.fail("Debian's awscli is missing: run `bash scripts/install.sh --test`")
    out = _example("aws-sts")
    assert "bucket holds hello.txt" in out
    last = out.splitlines()[-1]
    assert last.startswith("upstream saw: 2 signed request(s) with session credentials (ASIA...), never the stored key"), last
