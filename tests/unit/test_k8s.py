"""agent-vm on Kubernetes without a cluster: rendering (golden files per example agent), every
rendered object validated against the vendored agent-sandbox v1beta1 CRDs (strict) and core
kinds with kubernetes-validate, the security properties of the pod read off the objects, and
the requests claim/exec/rm build. Live tests run against a cluster when KUBECONFIG is set."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agentvm.errors import AgentVMError, ConfigError
from agentvm.k8s import cluster, validate
from agentvm.k8s.render import render, render_all, to_yaml

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "k8s_golden"
IMAGE = "registry.example/agentvm/agent@sha256:" + "0" * 64
EXAMPLES = ["hello-agent.yaml", "tools-agent.yaml", "tools-github-agent.yaml", "worker-agent.yaml", "images/agent.yaml"]


def _render_text(example: str) -> str:
    try:
        return to_yaml(render(ROOT / "examples" / example, namespace="team", warm_pool=2, image=IMAGE,
                              gateway_image="registry.example/agentvm/agentvm:0.1.0"))
    except AgentVMError as exc:  # an agent that cannot run on a cluster: its refusal is the golden text
        return f"# refused: [{exc.code}] {exc.message}\n"


@pytest.mark.parametrize("example", EXAMPLES)
def test_golden(example):
    golden = GOLDEN / (example.replace("/", "__").removesuffix(".yaml") + ".yaml")
    text = _render_text(example)
    if os.environ.get("AGENTVM_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"missing golden file {golden} (AGENTVM_UPDATE_GOLDEN=1 writes it; review it)"
    assert text == golden.read_text(), f"render of {example} changed (AGENTVM_UPDATE_GOLDEN=1 after review)"


def test_worker_agent_with_host_grants_is_refused():
    with pytest.raises(ConfigError) as e:
        render(ROOT / "examples" / "worker-agent.yaml", image=IMAGE)
    assert e.value.code == "k8s.render-invalid"


def _all_objects(identity_mode="claim"):
    objs = render_all([ROOT / "examples" / e for e in EXAMPLES if e != "worker-agent.yaml"], namespace="team",
                      warm_pool=3, image=IMAGE, identity_mode=identity_mode)
    return objs


@pytest.mark.parametrize("mode", ["claim", "template"])
def test_every_rendered_object_is_valid(mode):
    objs = _all_objects(mode)
    kinds = {o["kind"] for o in objs}
    assert {"SandboxTemplate", "SandboxWarmPool", "NetworkPolicy", "ConfigMap", "Deployment", "Service"} <= kinds
    assert ("Secret" in kinds) == (mode == "template")  # per claim: no identity Secret at all
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), "an object rendered twice"
    for o in objs:
        assert validate.problems(o) == [], o["kind"]
    # and the stream is what kubectl apply -f - reads: documents, in order
    docs = list(yaml.safe_load_all(to_yaml(objs)))
    assert docs == objs


def test_the_validators_reject_what_the_api_server_would():
    t = next(o for o in _all_objects() if o["kind"] == "SandboxTemplate")
    bad = yaml.safe_load(yaml.safe_dump(t))
    bad["spec"]["podTemplate"]["spec"]["containers"][0]["securityContxt"] = {}  # a misspelt field
    assert any("securityContxt" in p for p in validate.problems(bad))
    bad = yaml.safe_load(yaml.safe_dump(t))
    bad["spec"]["networkPolicyManagement"] = "Sometimes"  # not in the enum
    assert validate.problems(bad)
    bad = yaml.safe_load(yaml.safe_dump(t))
    del bad["spec"]["podTemplate"]  # required
    assert validate.problems(bad)
    pool = next(o for o in _all_objects() if o["kind"] == "SandboxWarmPool")
    bad = yaml.safe_load(yaml.safe_dump(pool))
    bad["spec"]["replicas"] = -1  # minimum 0
    assert validate.problems(bad)
    claim = cluster.claim_body("c1", "team", "hello-agent")
    assert validate.problems(claim) == []
    bad = dict(claim, spec={})  # v1beta1 claims need warmPoolRef
    assert validate.problems(bad)
    np_ = next(o for o in _all_objects() if o["kind"] == "NetworkPolicy")
    bad = yaml.safe_load(yaml.safe_dump(np_))
    bad["spec"]["egress"][0]["ports"][0]["protocol"] = 17  # core schema: a string
    assert validate.problems(bad)
    bad = yaml.safe_load(yaml.safe_dump(np_))
    bad["metadata"]["name"] = "Not_A_Name"
    assert validate.problems(bad)


def test_the_cel_rules_relied_on_are_known():
    """Checked by hand (validate.py's doc): the only CEL rule is Sandbox's immutable
    volumeClaimTemplates, a transition rule on updates of Sandboxes, which are never rendered.
    A new rule in a re-vendored CRD fails here until it is reviewed."""
    rules = validate.cel_rules()
    assert set(rules) == {"Sandbox"} and len(rules["Sandbox"]) == 1
    assert "oldSelf.volumeClaimTemplates" in rules["Sandbox"][0]
    assert "Sandbox" not in {o["kind"] for o in _all_objects()}


def _pod(objs, agent):
    t = next(o for o in objs if o["kind"] == "SandboxTemplate" and o["metadata"]["name"] == agent)
    return t, t["spec"]["podTemplate"]["spec"]


def test_the_sandbox_pod_is_hardened_and_holds_no_secret():
    objs = render(ROOT / "examples" / "tools-github-agent.yaml", namespace="team", image=IMAGE)
    t, pod = _pod(objs, "tools-github-agent")
    assert pod["automountServiceAccountToken"] is False and pod["shareProcessNamespace"] is False
    assert pod["runtimeClassName"] in ("gvisor", "kata")
    assert pod["securityContext"]["runAsNonRoot"] is True
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
        assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["seccompProfile"]["type"] in ("RuntimeDefault", "Localhost") and sc["runAsNonRoot"] is True
        assert all("valueFrom" not in e for e in c.get("env", ())), "no secretKeyRef in a sandbox"
        assert "envFrom" not in c
    agent, bridge = pod["containers"]
    assert agent["name"] == "agent" and bridge["name"] == "proxy-bridge"
    assert agent["securityContext"]["runAsUser"] != bridge["securityContext"]["runAsUser"]
    # per claim (the default): no Secret in the pod at all; the bridge alone mounts the pod's
    # annotations (the claim's token), the memory volume its key is made in, and the gateway's CA
    vols = {v["name"]: v for v in pod["volumes"]}
    assert not [n for n, v in vols.items() if "secret" in v or "projected" in v]
    assert vols["identity"] == {"name": "identity", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}
    assert vols["podinfo"]["downwardAPI"]["items"] == [{"path": "annotations",
                                                        "fieldRef": {"fieldPath": "metadata.annotations"}}]
    bridge_only = {"identity", "podinfo", "gateway-ca"}
    assert not bridge_only & {m["name"] for m in agent["volumeMounts"]}
    assert bridge_only <= {m["name"] for m in bridge["volumeMounts"]}
    assert "--enroll-token-file" in bridge["command"]
    # the template's own Secret (--identity template) is a volume of the bridge only
    _t2, pod2 = _pod(render(ROOT / "examples" / "tools-github-agent.yaml", namespace="team", image=IMAGE,
                            identity_mode="template"), "tools-github-agent")
    vols2 = {v["name"]: v for v in pod2["volumes"]}
    assert [n for n, v in vols2.items() if "secret" in v] == ["identity"]
    assert not any(m["name"] == "identity" for m in pod2["containers"][0]["volumeMounts"])
    assert any(m["name"] == "identity" for m in pod2["containers"][1]["volumeMounts"])
    # credentials: the pod holds placeholders, the gateway a reference to a Secret it alone mounts
    gw_cfg = yaml.safe_load(next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] ==
                                 "agentvm-gateway-config")["data"]["gateway.yaml"])
    phs = gw_cfg["agents"]["tools-github-agent"]["placeholders"]
    envs = {e["name"]: e.get("value") for e in agent["env"]}
    for name, ph in phs.items():
        assert ph in envs.values()
    refs = gw_cfg["agents"]["tools-github-agent"]["credentials"]
    dep = next(o for o in objs if o["kind"] == "Deployment")
    denv = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    for name, ref in refs.items():
        assert ref.startswith("env:") and denv[ref[4:]]["valueFrom"]["secretKeyRef"]["name"] == "agentvm-credentials"
    # the workspace is a claim template; the warm pool is not rendered unless asked
    assert t["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "workspace"
    assert "SandboxWarmPool" not in {o["kind"] for o in objs}


def test_the_network_policy_allows_the_gateway_only():
    objs = render(ROOT / "examples" / "hello-agent.yaml", namespace="team", image=IMAGE)
    np_ = next(o for o in objs if o["kind"] == "NetworkPolicy")
    t, pod = _pod(objs, "hello-agent")
    sel = np_["spec"]["podSelector"]["matchLabels"]
    assert all(t["spec"]["podTemplate"]["metadata"]["labels"].get(k) == v for k, v in sel.items())
    assert np_["spec"]["policyTypes"] == ["Ingress", "Egress"] and np_["spec"]["ingress"] == []
    (rule,) = np_["spec"]["egress"]
    assert rule["to"] == [{"podSelector": {"matchLabels": {"agentvm.dev/role": "gateway"}}}]
    # the gateway's proxy port and its enrolment port; no DNS (53) at all
    assert rule["ports"] == [{"protocol": "TCP", "port": 8443}, {"protocol": "TCP", "port": 8444}]
    objs2 = render(ROOT / "examples" / "hello-agent.yaml", namespace="team", image=IMAGE, identity_mode="template")
    (rule2,) = next(o for o in objs2 if o["kind"] == "NetworkPolicy")["spec"]["egress"]
    assert rule2["ports"] == [{"protocol": "TCP", "port": 8443}]
    gw = next(o for o in objs if o["kind"] == "Deployment")
    assert gw["spec"]["template"]["metadata"]["labels"]["agentvm.dev/role"] == "gateway"
    assert t["spec"]["networkPolicyManagement"] == "Unmanaged"


def test_the_rendered_gateway_config_loads_in_the_gateway(tmp_path):
    """The ConfigMap the render writes is a configuration source the gateway accepts."""
    from agentvm.gateway.config import Registry
    from agentvm.gateway.identity import Identity

    objs = render(ROOT / "examples" / "tools-github-agent.yaml", namespace="team", image=IMAGE)
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "agentvm-gateway-config")
    for k, v in cm["data"].items():
        (tmp_path / k).write_text(v)
    reg = Registry(tmp_path)
    assert reg.current().error is None, reg.current().error
    assert reg.admit(Identity("team", "tools-github-agent-7"), None).name == "tools-github-agent"
    assert reg.admit(Identity("other", "tools-github-agent"), None).rule_id == "identity:unknown"


def test_render_with_a_ca_mints_the_identity(tmp_path):
    from cryptography import x509

    from agentvm.gateway.ca import GatewayCA

    GatewayCA.create(tmp_path / "ca")
    out = subprocess.run([sys.executable, "-m", "agentvm", "k8s", "render", "-f", str(ROOT / "examples" / "hello-agent.yaml"),
                          "-n", "team", "--image", IMAGE, "--ca", str(tmp_path / "ca"), "--identity", "template"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    secret = next(d for d in yaml.safe_load_all(out.stdout) if d["kind"] == "Secret")
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["agentvm://team/hello-agent"]
    assert validate.problems(secret) == []


def test_claim_exec_rm_build_the_requests_the_client_sends():
    calls = []

    class Rec:
        def __getattr__(self, name):
            def f(**kw):
                calls.append((name, kw))
                if name == "get_namespaced_custom_object":
                    return ({"status": {"sandbox": {"name": "sb-1"}}} if kw["plural"] == "sandboxclaims"
                            else {"status": {"selector": "agents.x-k8s.io/sandbox=sb-1"}})
                if name == "list_namespaced_pod":
                    return type("L", (), {"items": [type("P", (), {"metadata": type("M", (), {"name": "pod-1"})})]})
                return {"metadata": {"name": kw.get("name") or kw.get("body", {}).get("metadata", {}).get("name")}}
            return f

    c = cluster.Cluster(custom=Rec(), core=Rec())
    c.claim("c1", "team", "hello-agent")
    name, kw = calls[-1]
    assert name == "create_namespaced_custom_object"
    assert (kw["group"], kw["version"], kw["plural"], kw["namespace"]) == ("extensions.agents.x-k8s.io", "v1beta1",
                                                                          "sandboxclaims", "team")
    assert kw["body"]["spec"]["warmPoolRef"] == {"name": "hello-agent"}
    assert kw["body"]["spec"]["lifecycle"]["shutdownPolicy"] == "Delete"
    assert c.pod_of("c1", "team") == "pod-1"
    assert calls[-1] == ("list_namespaced_pod", {"namespace": "team", "label_selector": "agents.x-k8s.io/sandbox=sb-1"})
    c.rm("c1", "team")
    assert calls[-1][0] == "delete_namespaced_custom_object" and calls[-1][1]["name"] == "c1"
    c.revoke("agentvm://team/c1", "team")  # rm --revoke: a merge patch of revoked.yaml only
    assert calls[-2][0] == "read_namespaced_config_map" and calls[-1][0] == "patch_namespaced_config_map"
    assert list(calls[-1][1]["body"]["data"]) == ["revoked.yaml"]
    assert "agentvm://team/c1" in calls[-1][1]["body"]["data"]["revoked.yaml"]
    r = cluster.exec_request("pod-1", "team", ["sh", "-c", "true"])
    assert r["container"] == "agent" and r["command"] == ["sh", "-c", "true"] and r["tty"] is False
    with pytest.raises(ConfigError):
        cluster.claim_body("Bad_Name", "team", "p")

    class NotFound(Exception):
        status = 404

    class Boom:
        def __getattr__(self, name):
            def f(**kw):
                raise NotFound()
            return f

    with pytest.raises(AgentVMError) as e:
        cluster.Cluster(custom=Boom(), core=Boom()).rm("c1", "team")
    assert e.value.code == "k8s.not-found"


live = pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="KUBECONFIG is not set: no cluster to claim from")


@live
def test_live_claim_exec_rm():  # pragma: no cover - needs a cluster with agent-sandbox and the rendered objects
    c = cluster.Cluster()
    ns, pool = os.environ.get("AGENTVM_K8S_NAMESPACE", "default"), os.environ.get("AGENTVM_K8S_POOL", "hello-agent")
    name = f"{pool}-live-{os.getpid()}"
    key = os.environ.get("AGENTVM_ENROLL_KEY")  # per-claim identity (the default render) needs the issuer's enroll.key
    c.claim(name, ns, pool, annotations=cluster.enrolment_annotations(name, ns, pool, key) if key else None)
    try:
        import time

        deadline = time.monotonic() + 180
        while True:
            try:
                c.pod_of(name, ns)
                break
            except AgentVMError:
                assert time.monotonic() < deadline, "the claim got no pod in 180 s"
                time.sleep(2)
        code, out, _ = c.exec(name, ns, ["sh", "-c", "echo hi"])
        assert code == 0 and out.strip() == "hi"
        # egress through the gateway: a host the policy does not allow is denied by the gateway
        code, out, _ = c.exec(name, ns, ["sh", "-c", "curl -s -o /dev/null -w '%{http_code}' https://denied.invalid/"])
        assert out.strip() in ("403", "000")
    finally:
        c.rm(name, ns)


def test_render_per_claim_with_a_ca_publishes_only_the_ca_certificate(tmp_path):
    from agentvm.gateway.ca import GatewayCA

    ca = GatewayCA.create(tmp_path / "ca")
    out = subprocess.run([sys.executable, "-m", "agentvm", "k8s", "render", "-f", str(ROOT / "examples" / "hello-agent.yaml"),
                          "-n", "team", "--image", IMAGE, "--ca", str(tmp_path / "ca")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs = list(yaml.safe_load_all(out.stdout))
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "agentvm-gateway-ca")
    assert cm["data"]["ca.pem"] == ca.cert_pem.decode()
    assert "PRIVATE KEY" not in out.stdout and not any(d["kind"] == "Secret" for d in docs)
    assert all(validate.problems(d) == [] for d in docs)


def test_the_rendered_commands_are_ones_the_cli_takes():
    """The bridge's and the gateway's command lines in the render parse with agentvm's own CLI
    (an option renamed on one side would leave every pod crash-looping)."""
    from agentvm.cli.gateway_cmds import gateway

    objs = render(ROOT / "examples" / "hello-agent.yaml", namespace="team", image=IMAGE)
    _t, pod = _pod(objs, "hello-agent")
    dep = next(o for o in objs if o["kind"] == "Deployment")
    for argv in (pod["containers"][1]["command"], dep["spec"]["template"]["spec"]["containers"][0]["command"]):
        assert argv[:2] == ["agentvm", "gateway"]
        cmd = gateway.commands[argv[2]]
        ctx = cmd.make_context(argv[2], list(argv[3:]))
        assert ctx.params  # parsed: every option exists
    bridge_params = gateway.commands["bridge"].make_context("bridge", list(pod["containers"][1]["command"][3:])).params
    assert str(bridge_params["enroll_token_file"]) == "/etc/agentvm/podinfo/annotations"
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][1]["volumeMounts"]}
    assert mounts["/etc/agentvm/podinfo"] == "podinfo" and mounts["/etc/agentvm/identity"] == "identity"
    gw_params = gateway.commands["serve"].make_context("serve", list(
        dep["spec"]["template"]["spec"]["containers"][0]["command"][3:])).params
    assert str(gw_params["issuer_dir"]) == "/etc/agentvm/gateway-issuer" and gw_params["enroll_port"] == 8444


def test_a_claim_carries_its_own_enrolment_token(tmp_path):
    """``k8s claim --enroll-key``: the SandboxClaim (valid against the vendored CRD) carries, as
    pod annotations, a token the gateway accepts for agentvm://NS/NAME and no other identity."""
    from agentvm.gateway import enroll as en
    from agentvm.gateway.ca import GatewayCA
    from agentvm.gateway.identity import Identity

    files = GatewayCA.create(tmp_path / "ca").make_issuer(tmp_path / "iss", namespaces=("team",))
    ann = cluster.enrolment_annotations("hello-agent-1", "team", "hello-agent", files["enroll.key"])
    body = cluster.claim_body("hello-agent-1", "team", "hello-agent", annotations=ann)
    assert validate.problems(body) == []
    got = body["spec"]["additionalPodMetadata"]["annotations"]
    assert got["agentvm.dev/identity"] == "agentvm://team/hello-agent-1"
    ident, _nonce, _exp = en.check_token(en.load_key(files["enroll.key"]), got[en.ANNOTATION])
    assert ident == Identity("team", "hello-agent-1")
    with pytest.raises(en.Refused):
        en.check_token(b"x" * 32, got[en.ANNOTATION])
    # the downwardAPI file as the kubelet writes it gives the bridge the token back
    (tmp_path / "annotations").write_text("".join(f"{k}={__import__('json').dumps(v)}\n" for k, v in got.items()))
    assert en.read_annotation(tmp_path / "annotations") == got[en.ANNOTATION]
    with pytest.raises(ConfigError):  # a name the rendered gateway would not map to the agent
        cluster.enrolment_annotations("other-1", "team", "hello-agent", files["enroll.key"])
    assert "additionalPodMetadata" not in cluster.claim_body("c1", "team", "hello-agent")["spec"]


def test_golden_claim(tmp_path):
    """What `agentvm k8s claim hello-agent-1 --pool hello-agent -n team --enroll-key K` sends
    (the token, random and timed, masked), valid against the vendored SandboxClaim CRD."""
    from agentvm.gateway.ca import GatewayCA

    files = GatewayCA.create(tmp_path / "ca").make_issuer(tmp_path / "iss", namespaces=("team",))
    body = cluster.claim_body("hello-agent-1", "team", "hello-agent", annotations=cluster.enrolment_annotations(
        "hello-agent-1", "team", "hello-agent", files["enroll.key"]))
    assert validate.problems(body) == []
    ann = body["spec"]["additionalPodMetadata"]["annotations"]
    assert ann["agentvm.dev/enroll-token"].startswith("v1.")
    ann["agentvm.dev/enroll-token"] = "v1.MASKED"
    text = to_yaml([body])
    golden = GOLDEN / "claim__hello-agent-1.yaml"
    if os.environ.get("AGENTVM_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.exists() and text == golden.read_text(), "claim body changed (AGENTVM_UPDATE_GOLDEN=1 after review)"
