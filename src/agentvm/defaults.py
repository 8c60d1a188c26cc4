"""Default values shared by the spec models and the CLI's fast path (no pydantic import)."""

MEMORY = 512 * 1024**2
CPUS = 1.0
PIDS = 256
DISK = 1024**3
TIMEOUT = 0.0  # none
TMP = 256 * 1024**2
SHM = 64 * 1024**2
NOFILE = 4096
RISK_TIER = "L2"
WORKSPACE_PATH = "/workspace"
HOME_PATH = "/home/agent"
# The sandbox's own scratch space (private tmpfs, read-write with every Landlock right)
SCRATCH_PATHS = ("/tmp", "/dev/shm", HOME_PATH)
# Sandbox paths agent-vm owns: a grant may not cover or shadow them.
RESERVED_SANDBOX_PATHS = ("/", "/proc", "/dev", "/sys", "/usr", "/etc", "/bin", "/lib", "/lib64", "/sbin", "/.agentvm")
# Host paths never exposed through rootfs.extraPaths.
FORBIDDEN_EXTRA_PATHS = ("/", "/root", "/home", "/etc", "/proc", "/sys", "/dev", "/run", "/var/lib/agentvm")


def abs_path(v: str, what: str) -> str:
    """Normalise an absolute path; refuse relative paths, NUL, '.' and '..'."""
    if not isinstance(v, str) or not v.startswith("/"):
        raise ValueError(f"{what} must be an absolute path")
    if "\x00" in v:
        raise ValueError(f"{what} must not contain NUL")
    parts = [p for p in v.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ValueError(f"{what} must not contain '.' or '..' components")
    return "/" + "/".join(parts)


def sandbox_path(v: str, what: str) -> str:
    p = abs_path(v, what)
    for r in RESERVED_SANDBOX_PATHS:
        if p == r or (r != "/" and p.startswith(r + "/")):
            raise ValueError(f"sandbox path {p} is reserved by agent-vm ({r})")
    return p
# OpenAI- and Anthropic-compatible APIs (the default ``limits.budget.hosts``)
LLM_HOSTS = ("api.openai.com", "api.anthropic.com", "*.openai.azure.com", "openrouter.ai", "api.groq.com",
             "api.mistral.ai", "api.deepseek.com", "api.together.xyz", "api.fireworks.ai", "api.x.ai")
