"""HTTP/1.1 syntax shared by the head parser (``h1``) and the body and response framing
(``framing``): token characters, control characters, what a request target must not hold."""

from __future__ import annotations

import re

VALUE_CTL_RE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # control characters but HTAB (values, reasons)
# every byte VALUE_CTL_RE does not match: ``text.translate(None, NOT_CTL)`` leaves only the
# control characters of ``text`` (a test holds the two to each other)
NOT_CTL = bytes(b for b in range(256) if b == 0x09 or 0x20 <= b < 0x7f or b > 0x7f)
TCHAR = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"  # RFC 9110 token characters
TOKEN_RE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")  # a method or a header name (RFC 9110 token)
TARGET_BAD_RE = re.compile(rb"[\x00-\x20\x7f-\xff]")  # what a request target must not hold
