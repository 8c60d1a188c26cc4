"""Every error code agent-vm answers with, in one registry: its HTTP status (the daemon's API),
its exit code (the CLI) and what it means.

An :class:`agentvm.errors.AgentVMError` takes its status and exit code from here, by its code,
so the same condition fails the same way embedded, through the daemon's API and on the CLI
(one map, not one per layer). ``docs/cli.md`` lists this table (``python -m agentvm.errorcodes``
prints it) and a test checks the two agree, and that every code the source raises is here.

The gate's rule ids (``default-deny``, ``credential:leak:NAME``, ...) are another namespace:
what a denied *request* carries (``X-Agentvm-Denied``), registered in ``agentvm.gate.rules``.
The helper's step names (``validate``, ``landlock``, ...) name where a sandbox's setup failed
(``setup_error.step``): :data:`HELPER_STEPS`.
"""

from __future__ import annotations

from dataclasses import dataclass

# exit codes (docs/cli.md)
CONFIG, POLICY, BACKEND, USAGE, FAILED, TEMPFAIL = 78, 77, 125, 2, 1, 75


@dataclass(frozen=True)
class Code:
    """An error code: its dotted name, the API's HTTP status, the CLI's exit code, what it means."""
    code: str
    status: int  # the daemon API's HTTP status
    exit: int  # the CLI's exit code
    meaning: str


_TABLE: list[tuple[str, int, int, str]] = [
    # -- the families (a subclass without a code of its own answers as its family)
    ("config.invalid", 400, CONFIG, "invalid input: an option, a value, a request body or query"),
    ("spec.invalid", 400, CONFIG, "an agent or preset file is invalid (file:line: field: problem)"),
    ("env.unsupported", 409, POLICY, "the host cannot give a guarantee the policy relies on"),
    ("env.primitive-missing", 409, POLICY, "a kernel primitive the policy needs is missing (fail closed)"),
    ("policy.denied", 403, POLICY, "the policy forbids what was asked"),
    ("backend.error", 500, BACKEND, "the substrate failed to do its job"),
    ("backend.launch-failed", 500, BACKEND, "a step of sandbox setup failed (the step is named)"),
    ("backend.teardown-unverified", 500, BACKEND, "teardown could not be verified"),
    ("internal.bug", 500, BACKEND, "a bug in agent-vm (the daemon's log has the traceback)"),
    # -- the daemon's API
    ("api.bad-request", 400, CONFIG, "a request the API cannot take (not HTTP, not a JSON object, a bad query)"),
    ("api.no-route", 404, CONFIG, "no route for this method and path"),
    ("api.method-not-allowed", 405, CONFIG, "the route does not take this method"),
    ("api.unauthorized", 401, POLICY, "the TCP listener needs the bearer token"),
    ("api.timeout", 408, CONFIG, "the request's head or body did not arrive in time"),
    ("api.too-large", 413, CONFIG, "the request body is over the limit"),
    ("api.busy", 429, BACKEND, "too many large uploads at once; retry"),
    ("console.no-listener", 409, CONFIG, "the console needs the daemon's TCP listener (agentvm up --listen)"),
    ("daemon.error", 500, BACKEND, "the daemon answered with an error it did not name"),
    ("daemon.unavailable", 503, BACKEND, "no daemon answers on the socket or URL"),
    ("daemon.timeout", 504, BACKEND, "the daemon did not answer in time (AGENTVM_CLIENT_TIMEOUT)"),
    ("daemon.needed", 409, CONFIG, "this needs the daemon that owns the agent: start it (agentvm up)"),
    ("state.unavailable", 503, BACKEND, "a state database is busy, locked or cannot be opened"),
    ("state.disk-full", 507, TEMPFAIL, "the disk holding agent-vm's state is full: free space and retry"),
    ("state.unwritable", 507, BACKEND, "agent-vm's state cannot be written (the disk is full or read-only)"),
    ("state.lost", 409, CONFIG, "a state database agent-vm made is missing or empty: refusing to start over"),
    ("audit.lost", 409, CONFIG, "the audit chain agent-vm made is missing"),
    ("audit.broken-chain", 409, CONFIG, "the audit chain does not verify (up --accept-broken-chain)"),
    # -- sandboxes
    ("sandbox.not-found", 404, CONFIG, "no sandbox by that name"),
    ("sandbox.exists", 409, CONFIG, "a sandbox by that name exists"),
    ("sandbox.already-running", 409, CONFIG, "the sandbox is already running"),
    ("sandbox.not-running", 409, CONFIG, "the sandbox is not running (start it first)"),
    ("sandbox.start-failed", 500, BACKEND, "a persistent sandbox failed to start and was not restarted"),
    ("sandbox.suspended", 409, CONFIG, "the sandbox is suspended (resume it first: `agentvm resume NAME`)"),
    ("sandbox.not-suspended", 409, CONFIG, "the sandbox is not suspended: nothing to resume"),
    ("sandbox.paused", 409, CONFIG, "the sandbox is paused (`agentvm unpause NAME`)"),
    ("sandbox.suspend-busy", 409, TEMPFAIL, "an egress connection is open: the sandbox cannot be checkpointed now"),
    ("backend.suspend-unsupported", 409, POLICY, "this substrate cannot suspend a sandbox faithfully (use pause, or gVisor)"),
    ("backend.pause-unsupported", 409, POLICY, "this substrate or sandbox has no cgroup freezer to pause it"),
    ("checkpoint.missing", 404, CONFIG, "the sandbox's checkpoint is gone"),
    ("snapshot.not-found", 404, CONFIG, "no snapshot by that id or tag"),
    ("snapshot.too-large", 413, CONFIG, "the workspace's files, at their full length (a snapshot stores no holes), exceed the agent's disk limit"),
    ("snapshot.no-room", 507, TEMPFAIL, "no room for the snapshot: the workspace's disk limit or the host's free space above its reserve (nothing was changed)"),
    ("snapshot.policy-wider", 409, POLICY, "a fork would run under a wider policy than the snapshot was taken under"),
    ("snapshot.memory-unsupported", 409, POLICY, "this substrate cannot checkpoint processes faithfully: snapshot the workspace only, or use gVisor"),
    ("checkpoint.tampered", 409, POLICY, "a checkpoint or snapshot no longer matches the digest recorded for it"),
    ("checkpoint.policy-changed", 409, POLICY, "the checkpoint was taken under another policy (stop and start instead)"),
    ("logs.not-found", 404, CONFIG, "no run or sandbox by that name"),
    ("files.bad-path", 403, POLICY, "a workspace path that leaves the workspace"),
    ("files.not-found", 404, CONFIG, "no such file in the workspace"),
    ("files.not-regular", 403, POLICY, "not a regular file"),
    ("files.symlink", 403, POLICY, "a symbolic link on the way"),
    ("files.too-large", 403, POLICY, "the file is over the copy limit"),
    ("files.no-space", 507, BACKEND, "the workspace is full"),
    # -- the E2B-compatible API (docs/e2b.md)
    ("e2b.network-refused", 403, POLICY, "an E2B create asked for egress its template does not allow"),
    ("e2b.env-refused", 403, POLICY, "an E2B create's envs set a variable the policy owns (credentials by reference)"),
    ("e2b.bad-request", 400, CONFIG, "an E2B request agent-vm cannot honour as asked"),
    ("e2b.template-not-found", 404, CONFIG, "no E2B template by that name (`agentvm template ls`)"),
    ("e2b.not-serving", 409, CONFIG, "the E2B API is not being served (`agentvm e2b serve`)"),
    ("e2b.port-refused", 403, POLICY, "an E2B port its template does not open (`agentvm template add FILE --port N`)"),
    ("e2b.port-unreachable", 502, BACKEND, "nothing listens on that port in the sandbox, or its network namespace cannot be joined"),
    ("workspace.bad-name", 400, CONFIG, "not a workspace name"),
    ("workspace.not-found", 404, CONFIG, "no workspace by that name"),
    ("workspace.in-use", 409, POLICY, "a sandbox of the agent is running on it"),
    ("workspace.owned", 409, POLICY, "the workspace belongs to a declared agent (agentvm rm it)"),
    ("workspace.owners-unknown", 409, POLICY, "which workspaces belong to an agent cannot be read"),
    ("workspace.overcommit", 507, BACKEND, "the host cannot hold it: running agents' workspace limits would exceed the pool's free space times the overcommit factor"),
    # -- live policy
    ("policy.invalid-rule", 400, CONFIG, "not an egress rule (HOST[:PORT])"),
    ("policy.no-such-rule", 404, CONFIG, "the sandbox has no rule by that id"),
    ("policy.rule-not-removable", 409, POLICY, "a deny rule every sandbox gets cannot be removed"),
    ("policy.no-such-credential", 404, CONFIG, "the sandbox has no credential by that name"),
    ("policy.gate-worker", 409, CONFIG, "a gate worker cannot meter an LLM budget (restart the sandbox)"),
    ("limits.invalid", 400, CONFIG, "a live limit that is not a value or below the minimum"),
    ("limits.unsupported", 409, CONFIG, "the substrate cannot change that limit live"),
    ("budget.invalid", 400, CONFIG, "a budget that is not a positive number"),
    ("tools.none-declared", 409, CONFIG, "the sandbox declares no tools"),
    ("tools.invalid-change", 400, CONFIG, "a live tool change that is not valid"),
    # -- grants and the substrate
    ("policy.fake-substrate", 403, POLICY, "the fake substrate is for tests (AGENTVM_ALLOW_FAKE)"),
    ("policy.grant-forbidden", 403, POLICY, "granting that path would expose the host"),
    ("policy.grant-home", 403, POLICY, "a home folder itself, or its dot-files, cannot be granted"),
    ("policy.grant-path", 400, CONFIG, "a grant's path is not usable"),
    ("policy.grant-trusted-link", 403, POLICY, "a trusted name in a grant is a link"),
    ("policy.grant-unreachable", 403, POLICY, "the sandbox's uid cannot reach the granted folder"),
    ("policy.grant-untrusted-link", 403, POLICY, "a grant through a link the operator does not own"),
    ("policy.grant-unwritable", 403, POLICY, "a read-write grant the sandbox's uid cannot write"),
    ("policy.review-unsupported", 409, POLICY, "the substrate cannot give review-mode grants (refused, never rw)"),
    # -- review-mode grants (agentvm diff / accept / discard)
    ("review.not-found", 404, CONFIG, "no review layer by that name (agentvm reviews lists them)"),
    ("review.running", 409, CONFIG, "a running sandbox uses the review layer (stop it, or accept --expect ID)"),
    ("review.changed", 409, CONFIG, "the review layer changed since the diff (look again)"),
    ("review.refused", 403, POLICY, "the layer holds entries never applied (special files, links out, host-trusted names)"),
    ("review.conflict", 409, FAILED, "paths changed on the host since the sandbox started (nothing applied)"),
    ("review.mismatch", 409, CONFIG, "the layer does not match the granted folder (replaced, or another folder)"),
    ("policy.min-substrate", 403, POLICY, "the agent needs a stronger substrate than asked"),
    ("policy.unenforceable", 403, POLICY, "the policy asks for something this host cannot enforce"),
    # -- the gate and credentials
    ("gate.timeout", 504, BACKEND, "the daemon's gate did not answer in time"),
    ("gate.worker-lost", 500, BACKEND, "the gate worker serving the sandbox died"),
    ("gate.no-worker-slot", 503, TEMPFAIL, "every confined gate worker slot serves another running agent: the start is refused"),
    ("gate.confine-failed", 500, BACKEND, "a gate worker could not confine itself (the step is named); it does not serve"),
    ("gate.ca-invalid", 400, CONFIG, "the gate's CA files are not usable"),
    ("gate.ca-key-insecure", 400, CONFIG, "the gate's CA key is readable by others"),
    ("signing:error", 403, POLICY, "a request the gate cannot re-sign"),
    ("vault.error", 400, CONFIG, "the vault cannot be used"),
    ("vault.not-found", 404, CONFIG, "no secret by that name"),
    ("vault.key-insecure", 400, CONFIG, "the vault key is readable by others"),
    ("vault.insecure", 400, CONFIG, "the vault is readable by others"),
    ("vault.corrupt", 400, CONFIG, "the vault does not decrypt"),
    ("vault.invalid-name", 400, CONFIG, "not a secret name"),
    ("vault.invalid-value", 400, CONFIG, "not a secret value"),
    ("vault.ref-invalid", 400, CONFIG, "not a credential reference (vault:NAME, env:NAME)"),
    ("vault.ref-unresolved", 400, CONFIG, "a credential reference names nothing"),
    # -- approvals
    ("approvals.error", 409, USAGE, "the approvals queue refused the answer"),
    ("approvals.not-found", 404, USAGE, "no approval request by that id"),
    ("approvals.answered", 409, USAGE, "the request was answered already"),
    ("approvals.expired", 409, USAGE, "the request expired (its requester is gone): nothing waits for it"),
    ("approvals.digest-mismatch", 409, USAGE, "the request is not the one that was shown"),
    ("approvals.too-many", 429, USAGE, "the sandbox has too many requests waiting"),
    ("approvals.unavailable", 503, BACKEND, "the approvals queue cannot be opened"),
    # -- fleets
    ("fleet.error", 400, CONFIG, "the fleet repository cannot be read"),
    ("fleet.invalid", 400, CONFIG, "an agent of the fleet is invalid at that commit"),
    ("fleet.missing-object", 400, CONFIG, "the commit names an object the repository does not have"),
    ("fleet.unsigned", 409, CONFIG, "the commit is not signed by an allowed signer"),
    ("fleet.not-a-commit-id", 400, CONFIG, "apply takes a full commit id"),
    ("fleet.plan-changed", 409, CONFIG, "the plan changed since it was shown"),
    ("fleet.busy", 409, FAILED, "another apply or rollback is in progress"),
    ("fleet.no-rollback-target", 409, FAILED, "no earlier promotion to go back to"),
    ("fleet.no-such-promotion", 404, FAILED, "no promotion of that commit is recorded"),
    ("fleet.agent-failed", 409, FAILED, "an updated agent did not pass; the fleet was rolled back"),
    ("fleet.canary-name-taken", 409, FAILED, "a sandbox has the canary's name"),
    # -- the shared egress gateway and Kubernetes (docs/scale-out.md, docs/k8s.md)
    ("gateway.config-invalid", 400, CONFIG, "the gateway's configuration source is not valid"),
    ("gateway.ca-invalid", 400, CONFIG, "the gateway's CA files are missing or not usable (agentvm gateway init)"),
    ("gateway.identity-invalid", 400, CONFIG, "not a sandbox identity (agentvm://NAMESPACE/SANDBOX, DNS labels)"),
    ("gateway.enroll-refused", 403, POLICY, "the gateway refused to enrol or renew a sandbox's certificate"),
    ("k8s.render-invalid", 400, CONFIG, "the agent cannot be rendered for Kubernetes as declared"),
    ("k8s.unavailable", 503, BACKEND, "no Kubernetes cluster configured or reachable (KUBECONFIG)"),
    ("k8s.not-found", 404, CONFIG, "no such object in the cluster"),
    ("k8s.error", 500, BACKEND, "the Kubernetes API refused or failed the request"),
    # -- images
    ("image.error", 400, CONFIG, "an image could not be built, imported, stored or used"),
    ("image.ambiguous", 400, CONFIG, "a name that matches more than one image"),
    ("image.bad-archive", 400, CONFIG, "not an OCI layout or docker save archive"),
    ("image.bad-build", 400, CONFIG, "an image file that cannot be built"),
    ("image.build-failed", 400, CONFIG, "a build step failed"),
    ("image.corrupt", 400, CONFIG, "a stored image no longer matches its digest"),
    ("image.digest-mismatch", 400, CONFIG, "the content does not match the digest given"),
    ("image.hostile", 400, CONFIG, "an archive with hostile entries (refused)"),
    ("image.missing", 404, CONFIG, "no such image"),
    ("image.no-bwrap", 400, CONFIG, "bubblewrap is needed to build"),
    ("image.no-mmdebstrap", 400, CONFIG, "mmdebstrap is needed to build"),
    ("image.no-sources", 400, CONFIG, "no apt sources to build from"),
    ("image.sign-failed", 400, CONFIG, "the image could not be signed"),
    ("image.too-large", 400, CONFIG, "over the import size limit"),
    ("image.unsigned", 403, POLICY, "the tier needs a signed image"),
    ("image.unsupported", 400, CONFIG, "an image feature agent-vm does not support"),
    ("image.unusable", 400, CONFIG, "the image cannot be used as a root"),
    # -- other
    ("config.otlp-endpoint", 400, CONFIG, "not an OTLP/HTTP endpoint URL"),
    ("config.otlp-sample", 400, CONFIG, "not a sampling ratio"),
    ("sshsig.no-ssh-keygen", 400, CONFIG, "ssh-keygen is needed to verify signatures"),
    ("files.too-deep", 403, POLICY, "a folder nested deeper than a copy walks: copy a deeper folder on its own"),
    ("snapshot.too-deep", 413, CONFIG, "the workspace holds folders nested deeper than a snapshot walks"),
]

CODES: dict[str, Code] = {c: Code(c, s, e, m) for c, s, e, m in _TABLE}
assert len(CODES) == len(_TABLE), "a code registered twice"

# where a sandbox's setup failed (setup_error.step; docs/cli.md)
HELPER_STEPS = ("validate", "cgroup", "rlimit", "grant", "grant-idmap", "drop-privileges", "no-new-privs",
                "exec-bwrap", "tty", "chdir", "landlock", "seccomp", "exec", "bwrap", "bwrap-setup", "gate")


def lookup(code: str) -> Code | None:
    return CODES.get(code)


def markdown() -> str:
    """The table docs/cli.md carries (between its ``error-codes`` markers)."""
    rows = ["| code | HTTP | exit | meaning |", "|---|---|---|---|"]
    rows += [f"| `{c.code}` | {c.status} | {c.exit} | {c.meaning} |" for c in sorted(CODES.values(), key=lambda c: c.code)]
    return "\n".join(rows)


if __name__ == "__main__":  # pragma: no cover
    print(markdown())
