"""A sandbox's identity at the gateway: ``agentvm://NAMESPACE/SANDBOX``.

It is carried, and only carried, as the one URI in the subjectAltName of the client
certificate the gateway's CA minted for the sandbox (SPIFFE-like: scheme, trust domain as
the namespace, the sandbox as the path). Nothing the sandbox sends - a header, a proxy
credential, an SNI - can name another identity."""

from __future__ import annotations

import re
from dataclasses import dataclass

from agentvm.errors import ConfigError

SCHEME = "agentvm"
_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")  # an RFC 1123 DNS label (Kubernetes names)


def _label(value: str, what: str) -> str:
    if not isinstance(value, str) or not _LABEL.match(value):
        raise ConfigError(f"{what} {value!r} is not a DNS label (lower-case letters, digits, '-', at most 63)",
                          code="gateway.identity-invalid")
    return value


@dataclass(frozen=True, order=True)
class Identity:
    namespace: str
    sandbox: str

    def __post_init__(self) -> None:
        _label(self.namespace, "namespace")
        _label(self.sandbox, "sandbox")

    @property
    def uri(self) -> str:
        return f"{SCHEME}://{self.namespace}/{self.sandbox}"

    @property
    def key(self) -> str:
        """A file-name-safe, unique name: ``NAMESPACE.SANDBOX`` (a DNS label has no dot)."""
        return f"{self.namespace}.{self.sandbox}"

    @classmethod
    def parse(cls, text: str) -> "Identity":
        """``agentvm://NS/SANDBOX`` or ``NS/SANDBOX``."""
        if not isinstance(text, str):
            raise ConfigError("an identity must be a string", code="gateway.identity-invalid")
        rest = text[len(SCHEME) + 3:] if text.startswith(f"{SCHEME}://") else text
        ns, sep, sb = rest.partition("/")
        if not sep or "/" in sb:
            raise ConfigError(f"{text!r} is not a sandbox identity", hint="agentvm://NAMESPACE/SANDBOX",
                              code="gateway.identity-invalid")
        return cls(ns, sb)

    def __str__(self) -> str:
        return self.uri


def from_peercert(cert: dict | None) -> Identity | None:
    """The identity of a verified peer certificate (``SSLObject.getpeercert()``): exactly one
    URI SAN in the agentvm scheme, else None (a certificate that names two identities, or none,
    names nobody)."""
    if not cert:
        return None
    uris = [v for k, v in cert.get("subjectAltName", ()) if k == "URI"]
    ours = [u for u in uris if u.startswith(f"{SCHEME}://")]
    if len(ours) != 1 or len(uris) != 1:
        return None
    try:
        return Identity.parse(ours[0])
    except ConfigError:
        return None
