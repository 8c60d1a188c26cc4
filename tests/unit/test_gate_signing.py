"""Re-signing at the gate (agentvm.gate.signing): SigV4 and generic HMAC.

SigV4 requests are produced by botocore itself (SigV4Auth / S3SigV4Auth, boto3 clients and
presigned URLs) with the *placeholder* secret. The independent verifier is botocore signing
the very same request with the *real* secret at the same instant: the gate's output must
carry exactly that signature. AWS's published examples anchor the arithmetic."""

from __future__ import annotations

import base64
import hashlib
import hmac
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from unittest import mock

import boto3
import pytest
from botocore.auth import S3SigV4Auth, SigV4Auth
from botocore.awsrequest import AWSRequest, AWSResponse
from botocore.config import Config
from botocore.credentials import Credentials
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentvm.gate import signing
from agentvm.gate.signing import Request, SigningError, resign_hmac, resign_sigv4, sigv4_in_request

AKID = "AKIAAGENTVMTEST00001"
PH = "phSECRETplaceholder/0123456789+abcdefXYZ"
REAL = "reAL/SECRETvalue+9876543210zyxwvuABCDEFG"
WHEN = datetime(2024, 5, 1, 12, 0, 0, tzinfo=timezone.utc)


# --------------------------------------------------------------------------- helpers


def _frozen(when: datetime):
    return mock.patch("botocore.auth.get_current_datetime", return_value=when.replace(tzinfo=None))


def botocore_sign(method, url, headers, body, service, secret, *, region="us-east-1", akid=AKID, token=None,
                  when=WHEN, dup_headers=()):
    """A request signed by botocore at ``when``; returned as the wire would show it to the gate."""
    areq = AWSRequest(method=method, url=url, headers=dict(headers), data=body)
    for k, v in dup_headers:
        areq.headers[k] = v  # HTTPHeaders appends: a repeated header
    cls = S3SigV4Auth if service == "s3" else SigV4Auth
    with _frozen(when):
        cls(Credentials(akid, secret, token), service, region).add_auth(areq)
    return to_request(areq)


def to_request(areq) -> Request:
    from botocore.auth import _host_from_url

    hdrs = [("Host", _host_from_url(areq.url))]
    hdrs += [(k, v.decode("latin-1") if isinstance(v, bytes) else str(v)) for k, v in areq.headers.items()]
    body = areq.body if hasattr(areq, "body") else areq.data
    if body is None:
        body = b""
    elif isinstance(body, str):
        body = body.encode("utf-8")
    elif not isinstance(body, bytes):
        body = body.read()
    return Request(method=areq.method, url=areq.url, headers=hdrs, body=body)


def auth_of(req: Request) -> str:
    (v,) = req.header_values("authorization")
    return v


def sig_of(req: Request) -> str:
    return auth_of(req).rsplit("Signature=", 1)[1]


def resign(req, **kw):
    kw.setdefault("access_key_id", AKID)
    kw.setdefault("placeholder_secret", PH)
    kw.setdefault("real_secret", REAL)
    kw.setdefault("now", WHEN + timedelta(seconds=3))
    return resign_sigv4(req, **kw)


def verifies_with(req: Request, secret: str, now=WHEN) -> bool:
    """Our own verifier: does ``req`` carry a valid signature made with ``secret``?"""
    try:
        resign(req, placeholder_secret=secret, real_secret="irrelevant", now=now)
        return True
    except SigningError as e:
        assert e.code == "sigv4:bad-signature", e.code
        return False


def code_of(fn, *a, **kw) -> str:
    with pytest.raises(SigningError) as ei:
        fn(*a, **kw)
    return ei.value.code


def replace_header(req: Request, name: str, value: str) -> Request:
    return Request(req.method, req.url, [(k, value if k.lower() == name.lower() else v) for k, v in req.headers],
                   req.body)


# --------------------------------------------------------------------------- SigV4 header form

CASES = {
    "s3-get-query": dict(
        method="GET",
        url="https://s3.test/bucket/some%20dir/x~y.txt?list-type=2&prefix=a%2Fb%20c&max-keys=5&encoding-type=url",
        headers={"Range": "bytes=0-9"},
        body=b"",
        service="s3",
    ),
    "s3-put-body": dict(
        method="PUT",
        url="https://s3.test/bucket/obj%2Bplus/%E2%82%AC.bin",
        headers={"Content-Type": "application/octet-stream", "X-Amz-Meta-Note": "  two   spaces  "},
        body=bytes(range(256)) * 4,
        service="s3",
    ),
    "s3-port-acl": dict(
        method="PUT",
        url="https://s3.test:8443/bucket/k?acl",
        headers={"x-amz-acl": "private"},
        body=b"<AccessControlPolicy/>",
        service="s3",
    ),
    "sts-post-form": dict(
        method="POST",
        url="https://sts.us-east-1.test/",
        headers={"Content-Type": "application/x-www-form-urlencoded; charset=utf-8"},
        body=b"Action=GetCallerIdentity&Version=2011-06-15",
        service="sts",
    ),
    "dynamodb-json": dict(
        method="POST",
        url="https://dynamodb.us-east-1.test/",
        headers={"Content-Type": "application/x-amz-json-1.0", "X-Amz-Target": "DynamoDB_20120810.GetItem"},
        body=b'{"TableName": "t", "Key": {"k": {"S": "v\\u00e9"}}}',
        service="dynamodb",
    ),
    "apigw-double-encoded-path": dict(
        method="GET",
        url="https://api.test/stage/a%20b//c/./d/../e?z=1&a=%7E&a=2&empty=",
        headers={},
        body=b"",
        service="execute-api",
    ),
}


@pytest.fixture(params=sorted(CASES))
def case(request):
    return CASES[request.param]


def test_resigned_request_is_what_botocore_signs_with_the_real_key(case):
    agent = botocore_sign(**case, secret=PH)
    expected = botocore_sign(**case, secret=REAL)  # the independent verifier
    assert sigv4_in_request(agent)
    out = resign(agent)
    assert auth_of(out) == auth_of(expected)
    assert sig_of(out) != sig_of(agent)
    # nothing else changed
    assert out.method == agent.method and out.url == agent.url and out.body == agent.body
    assert [(k, v) for k, v in out.headers if k.lower() != "authorization"] == [
        (k, v) for k, v in agent.headers if k.lower() != "authorization"
    ]
    assert [k for k, _ in out.headers] == [k for k, _ in agent.headers]
    assert verifies_with(out, REAL) and not verifies_with(out, PH)
    assert verifies_with(agent, PH) and not verifies_with(agent, REAL)


def test_session_token_passes_through_untouched():
    c = dict(CASES["dynamodb-json"])
    agent = botocore_sign(**c, secret=PH, token="FwoGZXIvYXdzEXAMPLETOKEN//+=")
    expected = botocore_sign(**c, secret=REAL, token="FwoGZXIvYXdzEXAMPLETOKEN//+=")
    out = resign(agent)
    assert out.header_values("x-amz-security-token") == ["FwoGZXIvYXdzEXAMPLETOKEN//+="]
    assert "x-amz-security-token" in auth_of(out)
    assert auth_of(out) == auth_of(expected)


def test_repeated_signed_header_and_unsigned_extra_headers():
    c = dict(CASES["dynamodb-json"])
    agent = botocore_sign(**c, secret=PH, dup_headers=[("X-Amz-Meta-Tag", "a"), ("X-Amz-Meta-Tag", "b  c")])
    expected = botocore_sign(**c, secret=REAL, dup_headers=[("X-Amz-Meta-Tag", "a"), ("X-Amz-Meta-Tag", "b  c")])
    assert "x-amz-meta-tag" in auth_of(agent)
    # headers botocore never signs, added after signing (SDKs add these), do not matter
    agent = Request(agent.method, agent.url, agent.headers + [("User-Agent", "x"), ("Expect", "100-continue")],
                    agent.body)
    out = resign(agent)
    assert auth_of(out) == auth_of(expected)
    # but the order of a repeated signed header does
    swapped = [(k, {"a": "b  c", "b  c": "a"}[v]) if k == "X-Amz-Meta-Tag" else (k, v) for k, v in agent.headers]
    assert code_of(resign, Request(agent.method, agent.url, swapped, agent.body)) == "sigv4:bad-signature"


def test_host_header_may_be_absent_then_derived_from_url():
    agent = botocore_sign(**CASES["s3-port-acl"], secret=PH)
    expected = botocore_sign(**CASES["s3-port-acl"], secret=REAL)
    no_host = Request(agent.method, agent.url, [(k, v) for k, v in agent.headers if k != "Host"], agent.body)
    assert auth_of(resign(no_host)) == auth_of(expected)


def test_date_header_instead_of_x_amz_date():
    areq = AWSRequest(method="GET", url="https://sqs.test/?Action=ListQueues", headers={"Date": "x"}, data=b"")
    areq2 = AWSRequest(method="GET", url="https://sqs.test/?Action=ListQueues", headers={"Date": "x"}, data=b"")
    with _frozen(WHEN):
        SigV4Auth(Credentials(AKID, PH), "sqs", "eu-west-1").add_auth(areq)
        SigV4Auth(Credentials(AKID, REAL), "sqs", "eu-west-1").add_auth(areq2)
    agent = to_request(areq)
    assert not agent.header_values("x-amz-date") and agent.header_values("date")
    assert auth_of(resign(agent)) == auth_of(to_request(areq2))


def test_uppercase_hex_signature_is_accepted():
    agent = botocore_sign(**CASES["sts-post-form"], secret=PH)
    s = sig_of(agent)
    upper = replace_header(agent, "authorization", auth_of(agent).replace(s, s.upper()))
    expected = botocore_sign(**CASES["sts-post-form"], secret=REAL)
    assert sig_of(resign(upper)) == sig_of(expected)


def test_host_header_with_default_port_and_secret_checks():
    agent = botocore_sign(**CASES["sts-post-form"], secret=PH)
    # the same authority spelled differently is not "malformed"; but the Host value is signed
    assert code_of(resign, replace_header(agent, "host", "STS.us-east-1.test:443")) == "sigv4:bad-signature"
    assert code_of(resign, agent, real_secret="bad\ud800") == "sigv4:config"


# ---- AWS's published examples (independent anchor for the arithmetic) ----------------------

AWS_EXAMPLE_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


def test_aws_documented_s3_get_object_example():
    # https://docs.aws.amazon.com/AmazonS3/latest/API/sig-v4-header-based-auth.html (GET Object)
    req = Request(
        "GET",
        "https://examplebucket.s3.amazonaws.com/test.txt",
        [
            ("Host", "examplebucket.s3.amazonaws.com"),
            ("Range", "bytes=0-9"),
            ("x-amz-content-sha256", hashlib.sha256(b"").hexdigest()),
            ("x-amz-date", "20130524T000000Z"),
            (
                "Authorization",
                "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
                "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
                "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41",
            ),
        ],
        b"",
    )
    out = resign_sigv4(req, access_key_id="AKIAIOSFODNN7EXAMPLE", placeholder_secret=AWS_EXAMPLE_SECRET,
                       real_secret=REAL, now=datetime(2013, 5, 24, 0, 1, tzinfo=timezone.utc))
    assert "Signature=f0e8bdb8" not in auth_of(out)
    assert code_of(resign_sigv4, req, access_key_id="AKIAIOSFODNN7EXAMPLE", placeholder_secret=REAL,
                   real_secret=REAL, now=datetime(2013, 5, 24, tzinfo=timezone.utc)) == "sigv4:bad-signature"


def test_aws_documented_s3_presigned_example(monkeypatch):
    # https://docs.aws.amazon.com/AmazonS3/latest/API/sigv4-query-string-auth.html (its URL
    # lives a day: over the gate's cap, which is lifted here to check the arithmetic)
    from agentvm.gate import signing

    monkeypatch.setattr(signing, "_MAX_PRESIGN_EXPIRES", 7 * 24 * 3600)
    url = ("https://examplebucket.s3.amazonaws.com/test.txt?X-Amz-Algorithm=AWS4-HMAC-SHA256"
           "&X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20130524%2Fus-east-1%2Fs3%2Faws4_request"
           "&X-Amz-Date=20130524T000000Z&X-Amz-Expires=86400&X-Amz-SignedHeaders=host"
           "&X-Amz-Signature=aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404")
    req = Request("GET", url, [("Host", "examplebucket.s3.amazonaws.com")], b"")
    assert sigv4_in_request(req)
    out = resign_sigv4(req, access_key_id="AKIAIOSFODNN7EXAMPLE", placeholder_secret=AWS_EXAMPLE_SECRET,
                       real_secret=REAL, now=datetime(2013, 5, 24, 1, tzinfo=timezone.utc))
    assert out.url.startswith(url.rsplit("=", 1)[0] + "=") and out.url != url


# ---- tampering, wrong key, time ------------------------------------------------------------


def _tamperings(req: Request):
    yield "method", Request("POST" if req.method != "POST" else "PUT", req.url, req.headers, req.body)
    scheme, _, rest = req.url.partition("://")
    authority, slash, tail = rest.partition("/")
    yield "path", Request(req.method, f"{scheme}://{authority}/x{slash}{tail}", req.headers, req.body)
    yield "url-host", Request(req.method, f"{scheme}://evil.test/{tail}", req.headers, req.body)
    yield "query-added", Request(req.method, req.url + ("&" if "?" in req.url else "?") + "extra=1", req.headers,
                                 req.body)
    yield "host", replace_header(req, "host", "evil.test")
    yield "date", replace_header(req, "x-amz-date", (WHEN + timedelta(seconds=1)).strftime("%Y%m%dT%H%M%SZ"))
    if req.body:
        flipped = bytearray(req.body)
        flipped[len(flipped) // 2] ^= 0x01
        yield "body", Request(req.method, req.url, req.headers, bytes(flipped))
    else:
        yield "body-added", Request(req.method, req.url, req.headers, b"x")
    signed = auth_of(req).split("SignedHeaders=")[1].split(",")[0].split(";")
    for name in signed:
        if name not in ("host", "x-amz-date", "x-amz-content-sha256"):
            yield f"header-{name}", replace_header(req, name, req.header_values(name)[0] + "x")


def test_altered_after_signing_is_bad_signature(case):
    agent = botocore_sign(**case, secret=PH)
    for what, tampered in _tamperings(agent):
        expected = "sigv4:malformed" if what in ("url-host", "host") else "sigv4:bad-signature"
        assert code_of(resign, tampered) == expected, what


def test_signed_with_something_else_is_bad_signature(case):
    assert code_of(resign, botocore_sign(**case, secret="not-the-placeholder")) == "sigv4:bad-signature"
    # a request already carrying the real signature is not "verified" either
    assert code_of(resign, botocore_sign(**case, secret=REAL)) == "sigv4:bad-signature"


def test_region_or_service_swapped_in_scope_is_bad_signature():
    agent = botocore_sign(**CASES["dynamodb-json"], secret=PH)
    for a, b in (("/us-east-1/", "/us-west-2/"), ("/dynamodb/", "/sts/")):
        assert code_of(resign, replace_header(agent, "authorization", auth_of(agent).replace(a, b))) \
            == "sigv4:bad-signature"


def test_wrong_access_key_id():
    agent = botocore_sign(**CASES["sts-post-form"], secret=PH, akid="AKIAOTHERKEY00000000")
    assert code_of(resign, agent) == "sigv4:wrong-key"


@pytest.mark.parametrize("delta,ok", [(timedelta(minutes=14), True), (timedelta(minutes=-14), True),
                                      (timedelta(minutes=16), False), (timedelta(minutes=-16), False),
                                      (timedelta(days=3), False)])
def test_clock_skew(delta, ok):
    agent = botocore_sign(**CASES["sts-post-form"], secret=PH)
    if ok:
        resign(agent, now=WHEN + delta)
    else:
        assert code_of(resign, agent, now=WHEN + delta) == "sigv4:expired"
    assert code_of(resign, agent, now=WHEN + timedelta(minutes=3), max_skew=timedelta(minutes=2)) == "sigv4:expired"


def test_naive_now_is_utc():
    agent = botocore_sign(**CASES["sts-post-form"], secret=PH)
    resign(agent, now=WHEN.replace(tzinfo=None))


# ---- payload variants ---------------------------------------------------------------------


def _capture(service, call, *, config=None):
    """A real boto3 call, stopped just before it is sent; returns what the gate would see."""
    seen = []

    def before_send(request, **kw):
        seen.append(request)

        class Raw:
            def stream(self, **k):
                return iter([b""])

        return AWSResponse(request.url, 200, {}, Raw())

    client = boto3.client(service, region_name="us-east-1", aws_access_key_id=AKID, aws_secret_access_key=PH,
                          endpoint_url=f"https://{service}.test", config=config)
    client.meta.events.register("before-send", before_send)
    try:
        call(client)
    except Exception:
        pass  # our fake empty response does not parse; the request was captured
    return to_request(seen[0])


@pytest.mark.parametrize(
    "service,call,config",
    [
        ("sts", lambda c: c.get_caller_identity(), None),
        ("dynamodb", lambda c: c.put_item(TableName="t", Item={"k": {"S": "é ü"}}), None),
        ("s3", lambda c: c.list_objects_v2(Bucket="b", Prefix="dir/a b+c", MaxKeys=3), None),
        ("s3", lambda c: c.put_object(Bucket="b", Key="a b/c~d", Body=b"hello"),
         Config(request_checksum_calculation="when_required")),
        ("s3", lambda c: c.delete_objects(Bucket="b", Delete={"Objects": [{"Key": "k"}]}), None),
    ],
)
def test_real_boto3_requests_round_trip(service, call, config):
    agent = _capture(service, call, config=config)
    out = resign_sigv4(agent, access_key_id=AKID, placeholder_secret=PH, real_secret=REAL)
    now = datetime.now(timezone.utc)
    assert verifies_with(out, REAL, now) and not verifies_with(out, PH, now)


def test_boto3_default_s3_upload_is_unsigned_streaming_payload():
    agent = _capture("s3", lambda c: c.put_object(Bucket="b", Key="k", Body=b"hello"))
    assert agent.header_values("x-amz-content-sha256") == ["STREAMING-UNSIGNED-PAYLOAD-TRAILER"]
    assert code_of(resign_sigv4, agent, access_key_id=AKID, placeholder_secret=PH, real_secret=REAL) \
        == "sigv4:unsupported"
    out = resign_sigv4(agent, access_key_id=AKID, placeholder_secret=PH, real_secret=REAL,
                       allow_unsigned_payload=True)
    assert out.body == agent.body
    assert resign_sigv4(out, access_key_id=AKID, placeholder_secret=REAL, real_secret="x",
                        allow_unsigned_payload=True)


def test_unsigned_payload_header():
    c = dict(CASES["s3-put-body"])
    c["headers"] = dict(c["headers"], **{"Content-MD5": base64.b64encode(hashlib.md5(c["body"]).digest()).decode()})
    areq = AWSRequest(method=c["method"], url=c["url"], headers=c["headers"], data=c["body"])
    areq.context["client_config"] = Config(s3={"payload_signing_enabled": False})
    with _frozen(WHEN):
        S3SigV4Auth(Credentials(AKID, PH), "s3", "us-east-1").add_auth(areq)
    agent = to_request(areq)
    assert agent.header_values("x-amz-content-sha256") == ["UNSIGNED-PAYLOAD"]
    assert code_of(resign, agent) == "sigv4:unsupported"
    out = resign(agent, allow_unsigned_payload=True)
    areq2 = AWSRequest(method=c["method"], url=c["url"], headers=c["headers"], data=c["body"])
    areq2.context["client_config"] = Config(s3={"payload_signing_enabled": False})
    with _frozen(WHEN):
        S3SigV4Auth(Credentials(AKID, REAL), "s3", "us-east-1").add_auth(areq2)
    assert auth_of(out) == auth_of(to_request(areq2))


def test_chunk_signed_streaming_is_unsupported():
    agent = botocore_sign(**CASES["s3-put-body"], secret=PH)
    for v in ("STREAMING-AWS4-HMAC-SHA256-PAYLOAD", "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER",
              "STREAMING-AWS4-ECDSA-P256-SHA256-PAYLOAD"):
        r = replace_header(agent, "x-amz-content-sha256", v)
        assert code_of(resign, r) == "sigv4:unsupported"
        assert code_of(resign, r, allow_unsigned_payload=True) == "sigv4:unsupported"


def test_content_sha256_must_match_body():
    agent = botocore_sign(**CASES["s3-put-body"], secret=PH)
    r = Request(agent.method, agent.url, agent.headers, agent.body + b"!")
    assert code_of(resign, r) == "sigv4:bad-signature"
    assert code_of(resign, replace_header(agent, "x-amz-content-sha256", "nope")) == "sigv4:malformed"


# ---- malformed ----------------------------------------------------------------------------


def _with_auth(value: str) -> Request:
    agent = botocore_sign(**CASES["sts-post-form"], secret=PH)
    return replace_header(agent, "authorization", value)


GOOD_SIG = "a" * 64
MALFORMED_AUTH = [
    "AWS4-HMAC-SHA256 ",
    "AWS4-HMAC-SHA256 Credential=AKIAAGENTVMTEST00001/20240501/us-east-1/sts/aws4_request",
    f"AWS4-HMAC-SHA256 Credential={AKID}/20240501/us-east-1/sts/aws4_request, SignedHeaders=host, Signature=zz",
    f"AWS4-HMAC-SHA256 Credential={AKID}/20240501/us-east-1/sts, SignedHeaders=host, Signature={GOOD_SIG}",
    f"AWS4-HMAC-SHA256 Credential={AKID}/2024051/us-east-1/sts/aws4_request, SignedHeaders=host, Signature={GOOD_SIG}",
    f"AWS4-HMAC-SHA256 Credential={AKID}/20240501/us-east-1/sts/aws4_request, SignedHeaders=x-amz-date;host, "
    f"Signature={GOOD_SIG}",
    f"AWS4-HMAC-SHA256 Credential={AKID}/20240501/us-east-1/sts/aws4_request, SignedHeaders=Host;x-amz-date, "
    f"Signature={GOOD_SIG}",
    f"AWS4-HMAC-SHA256 Credential={AKID}/20240501/us-east-1/sts/aws4_request, SignedHeaders=x-amz-date, "
    f"Signature={GOOD_SIG}",
    f"AWS4-HMAC-SHA256 Credential={AKID}/20240501/us-east-1/sts/aws4_request, SignedHeaders=host;x-amz-date, "
    f"Signature={GOOD_SIG}, Signature={GOOD_SIG}",
    f"AWS4-HMAC-SHA256 Credential={AKID}/20240501/us-east-1/sts/aws4_request, SignedHeaders=host;x-amz-date;"
    f"x-missing, Signature={GOOD_SIG}",
    f"AWS4-HMAC-SHA256 Credential={AKID}/20240502/us-east-1/sts/aws4_request, SignedHeaders=host;x-amz-date, "
    f"Signature={GOOD_SIG}",
    f"AWS4-HMAC-SHA256 Credential={AKID}/20240501/us-east-1/sts/aws4_request, SignedHeaders=host, "
    f"Signature={GOOD_SIG}",  # x-amz-date present but not signed
    "Bearer abc",
]


@pytest.mark.parametrize("value", MALFORMED_AUTH)
def test_malformed_authorization(value):
    assert code_of(resign, _with_auth(value)) == "sigv4:malformed"


def test_sigv4a_and_missing_and_ambiguous():
    assert code_of(resign, _with_auth("AWS4-ECDSA-P256-SHA256 Credential=x")) == "sigv4:unsupported"
    agent = botocore_sign(**CASES["sts-post-form"], secret=PH)
    bare = Request(agent.method, agent.url, [(k, v) for k, v in agent.headers if k != "Authorization"], agent.body)
    assert not sigv4_in_request(bare)
    assert code_of(resign, bare) == "sigv4:missing"
    twice = Request(agent.method, agent.url, agent.headers + [("authorization", auth_of(agent))], agent.body)
    assert code_of(resign, twice) == "sigv4:malformed"
    both = Request(agent.method, agent.url + "?X-Amz-Signature=" + GOOD_SIG, agent.headers, agent.body)
    assert code_of(resign, both) == "sigv4:malformed"
    assert code_of(resign, replace_header(agent, "x-amz-date", "2024-05-01T12:00:00Z")) == "sigv4:malformed"
    dup_date = Request(agent.method, agent.url, agent.headers + [("X-Amz-Date", "20240501T120000Z")], agent.body)
    assert code_of(resign, dup_date) == "sigv4:malformed"
    assert code_of(resign, Request(agent.method, "/relative", agent.headers, agent.body)) == "sigv4:malformed"
    assert code_of(resign, replace_header(agent, "content-type", "a\r\nb")) == "sigv4:malformed"


# --------------------------------------------------------------------------- presigned URLs


def _presign(secret, *, key="dir/a b+c~(1).txt", expires=600, token=None, method="get_object", service="s3",
             params=None):
    client = boto3.client(service, region_name="eu-central-1", aws_access_key_id=AKID, aws_secret_access_key=secret,
                          aws_session_token=token, endpoint_url=f"https://{service}.test",
                          config=Config(signature_version="s3v4") if service == "s3" else None)
    if params is None:
        params = {"Bucket": "bucket", "Key": key, "ResponseContentType": "text/plain"} if service == "s3" else {}
    with _frozen(WHEN):
        return client.generate_presigned_url(method, Params=params, ExpiresIn=expires)


def _get(url: str, method: str = "GET") -> Request:
    host = url.split("/")[2]
    return Request(method, url, [("Host", host), ("User-Agent", "curl/8"), ("Accept", "*/*")], b"")


def test_presigned_s3_round_trip():
    agent_url, real_url = _presign(PH), _presign(REAL)
    assert "X-Amz-Signature=" in agent_url
    agent = _get(agent_url)
    assert sigv4_in_request(agent)
    out = resign(agent, now=WHEN + timedelta(seconds=599))
    assert out.url == real_url
    assert out.headers == agent.headers and out.body == agent.body
    assert verifies_with(out, REAL) and not verifies_with(out, PH)


def test_presigned_with_session_token_and_non_s3():
    agent, real = _get(_presign(PH, token="TOKEN/+=x")), _presign(REAL, token="TOKEN/+=x")
    assert "X-Amz-Security-Token=TOKEN%2F%2B%3Dx" in agent.url
    assert resign(agent).url == real
    # a query-protocol operation is presigned for its own HTTP method (POST, empty body)
    sts = _get(_presign(PH, service="sts", method="get_caller_identity"), "POST")
    assert resign(sts).url == _presign(REAL, service="sts", method="get_caller_identity")


def test_presigned_expiry_and_tampering():
    agent = _get(_presign(PH, expires=600))
    assert code_of(resign, agent, now=WHEN + timedelta(seconds=601)) == "sigv4:expired"
    assert code_of(resign, agent, now=WHEN - timedelta(minutes=16)) == "sigv4:expired"
    resign(agent, now=WHEN - timedelta(minutes=14))  # a little clock skew is fine
    for a, b in (("dir/a", "dir/b"), ("X-Amz-Expires=600", "X-Amz-Expires=6000"),
                 ("text%2Fplain", "text%2Fhtml"), ("eu-central-1", "us-east-1")):
        assert a in agent.url
        assert code_of(resign, Request("GET", agent.url.replace(a, b), agent.headers, b"")) in (
            "sigv4:bad-signature", "sigv4:malformed", "sigv4:expires-too-long"), a
    added = Request("GET", agent.url + "&versionId=1", agent.headers, b"")
    assert code_of(resign, added) == "sigv4:bad-signature"
    assert code_of(resign, replace_header(agent, "host", "other.test")) == "sigv4:malformed"
    other = _get(_presign("another-secret"))
    assert code_of(resign, other) == "sigv4:bad-signature"


def test_presigned_malformed_and_wrong_key():
    agent = _get(_presign(PH))
    drop = "&".join(p for p in agent.url.split("&") if not p.startswith("X-Amz-Expires="))
    assert code_of(resign, Request("GET", drop, agent.headers, b"")) == "sigv4:malformed"
    rep = Request("GET", agent.url + "&X-Amz-Date=20240501T120000Z", agent.headers, b"")
    assert code_of(resign, rep) == "sigv4:malformed"
    big = Request("GET", agent.url.replace("X-Amz-Expires=600", "X-Amz-Expires=604801"), agent.headers, b"")
    assert code_of(resign, big) == "sigv4:expires-too-long"


def test_a_presigned_url_the_gate_signs_lives_an_hour_at_most():
    """Review 8 (MEDIUM): an upstream that echoes the request hands the sandbox the URL signed
    with the real key - a capability that outlived the session (the gate accepted 7 days)."""
    assert code_of(resign, _get(_presign(PH, expires=3601))) == "sigv4:expires-too-long"
    assert resign(_get(_presign(PH, expires=3600))).url != _get(_presign(PH, expires=3600)).url


def test_what_re_signing_changed_is_paired_with_what_the_agent_sent():
    from agentvm.gate.signing import derived

    agent = _get(_presign(PH, expires=600))
    out = resign(agent)
    pairs = derived([agent.url], [out.url])
    real_sig = out.url.rsplit("X-Amz-Signature=", 1)[1]
    agent_sig = agent.url.rsplit("X-Amz-Signature=", 1)[1]
    assert pairs == [(real_sig.encode(), agent_sig.encode())]
    assert derived(["/same?x=1"], ["/same?x=1"]) == []
    assert code_of(resign, agent, access_key_id="AKIAOTHERKEY00000000") == "sigv4:wrong-key"


# --------------------------------------------------------------------------- HMAC

HMAC_DIGESTS = {"sha1": hashlib.sha1, "sha256": hashlib.sha256, "sha512": hashlib.sha512}


def _hmac_req(sig_header="X-Signature", sig_value="", *, body=b"{\"a\":1}\xff\x00", path="/hooks/v1?x=1&y=%20z"):
    return Request("POST", f"https://api.vendor.test{path}",
                   [("Host", "api.vendor.test"), ("X-Timestamp", "1714564800"), ("X-Request-Id", "rid-42"),
                    ("Content-Type", "application/json"), (sig_header, sig_value)], body)


def _enc(digest: bytes, encoding: str) -> str:
    return digest.hex() if encoding == "hex" else base64.b64encode(digest).decode()


@pytest.mark.parametrize("algorithm", ["sha1", "sha256", "sha512"])
@pytest.mark.parametrize("encoding", ["hex", "base64"])
def test_hmac_round_trip_every_algorithm_and_encoding(algorithm, encoding):
    cfg = SimpleNamespace(algorithm=algorithm, header="X-Signature", format=f"{algorithm}={{}}", encoding=encoding,
                          message="{method}\n{path}\n{timestamp}\n{body}", timestamp_header="X-Timestamp")
    body = b"{\"a\":1}\xff\x00"
    msg = b"POST\n/hooks/v1?x=1&y=%20z\n1714564800\n" + body
    agent_sig = _enc(hmac.new(PH.encode(), msg, HMAC_DIGESTS[algorithm]).digest(), encoding)
    real_sig = _enc(hmac.new(REAL.encode(), msg, HMAC_DIGESTS[algorithm]).digest(), encoding)
    req = _hmac_req(sig_value=f"{algorithm}={agent_sig}", body=body)
    out = resign_hmac(req, cfg, placeholder=PH, real=REAL)
    assert out.header_values("x-signature") == [f"{algorithm}={real_sig}"]
    assert [k for k, _ in out.headers] == [k for k, _ in req.headers] and out.body == req.body and out.url == req.url
    # re-signing the output with the real key as "placeholder" verifies; with the placeholder it does not
    resign_hmac(out, cfg, placeholder=REAL, real="x")
    assert code_of(resign_hmac, out, cfg, placeholder=PH, real=REAL) == "hmac:bad-signature"


def test_hmac_every_template_part_and_the_pydantic_model():
    from agentvm.spec.models import HmacSigning

    cfg = HmacSigning(header="x-sig", format="t=1,v1={}", message="{{literal}} é|{method}|{path}|{timestamp}|"
                      "{header:x-request-id}|{header:Content-Type}|{body}", timestamp_header="x-timestamp")
    body = "héllo".encode("utf-8") + b"\x80"
    msg = ("{literal} é|".encode("utf-8") + b"PUT|/p/%C3%A9?q=1|1714564800|rid-42|application/json|" + body)
    sig = hmac.new(PH.encode(), msg, hashlib.sha256).hexdigest()
    req = Request("PUT", "https://api.vendor.test/p/%C3%A9?q=1",
                  [("X-Timestamp", "1714564800"), ("X-Request-Id", "rid-42"), ("Content-Type", "application/json"),
                   ("X-Sig", f"t=1,v1={sig}")], body)
    assert signing.hmac_message(req, cfg) == msg
    out = resign_hmac(req, cfg, placeholder=PH, real=REAL)
    assert out.header_values("x-sig") == ["t=1,v1=" + hmac.new(REAL.encode(), msg, hashlib.sha256).hexdigest()]
    # uppercase hex keeps its case
    up = replace_header(req, "x-sig", f"t=1,v1={sig.upper()}")
    assert resign_hmac(up, cfg, placeholder=PH, real=REAL).header_values("x-sig") == [
        "t=1,v1=" + hmac.new(REAL.encode(), msg, hashlib.sha256).hexdigest().upper()]


def _signed_hmac_req(cfg, **kw):
    req = _hmac_req(**kw)
    sig = hmac.new(PH.encode(), signing.hmac_message(req, cfg), HMAC_DIGESTS[cfg.algorithm]).digest()
    return replace_header(req, cfg.header, cfg.format.replace("{}", _enc(sig, cfg.encoding)))


HCFG = SimpleNamespace(algorithm="sha256", header="X-Signature", format="{}", encoding="base64",
                       message="{method} {path} {timestamp} {header:X-Request-Id} {body}",
                       timestamp_header="X-Timestamp")


def test_hmac_tampering_detected():
    req = _signed_hmac_req(HCFG)
    resign_hmac(req, HCFG, placeholder=PH, real=REAL)
    tampered = [
        Request(req.method, req.url, req.headers, req.body + b" "),
        Request("PUT", req.url, req.headers, req.body),
        Request(req.method, req.url.replace("x=1", "x=2"), req.headers, req.body),
        replace_header(req, "x-timestamp", "1714564801"),
        replace_header(req, "x-request-id", "rid-43"),
    ]
    for t in tampered:
        assert code_of(resign_hmac, t, HCFG, placeholder=PH, real=REAL) == "hmac:bad-signature"
    # an unsigned header may change
    resign_hmac(replace_header(req, "content-type", "text/plain"), HCFG, placeholder=PH, real=REAL)
    # a signature made with another key
    other = hmac.new(b"other", signing.hmac_message(req, HCFG), hashlib.sha256).digest()
    assert code_of(resign_hmac, replace_header(req, "x-signature", base64.b64encode(other).decode()), HCFG,
                   placeholder=PH, real=REAL) == "hmac:bad-signature"


def test_hmac_malformed_missing_and_config():
    req = _signed_hmac_req(HCFG)
    assert code_of(resign_hmac, replace_header(req, "x-signature", "not base64!"), HCFG, placeholder=PH,
                   real=REAL) == "hmac:malformed"
    assert code_of(resign_hmac, replace_header(req, "x-signature", base64.b64encode(b"short").decode()), HCFG,
                   placeholder=PH, real=REAL) == "hmac:malformed"
    no_sig = Request(req.method, req.url, [(k, v) for k, v in req.headers if k != "X-Signature"], req.body)
    assert code_of(resign_hmac, no_sig, HCFG, placeholder=PH, real=REAL) == "hmac:missing"
    twice = Request(req.method, req.url, req.headers + [("x-signature", "AAAA")], req.body)
    assert code_of(resign_hmac, twice, HCFG, placeholder=PH, real=REAL) == "hmac:malformed"
    no_ts = Request(req.method, req.url, [(k, v) for k, v in req.headers if k != "X-Timestamp"], req.body)
    assert code_of(resign_hmac, no_ts, HCFG, placeholder=PH, real=REAL) == "hmac:malformed"
    fmt = SimpleNamespace(**dict(vars(HCFG), format="sha256={}"))
    assert code_of(resign_hmac, req, fmt, placeholder=PH, real=REAL) == "hmac:malformed"
    for bad in (dict(message="{nope}"), dict(message="{method"), dict(message="x}"), dict(algorithm="md5"),
                dict(encoding="b32"), dict(format="{}{}"), dict(timestamp_header=None)):
        cfg = SimpleNamespace(**dict(vars(HCFG), **bad))
        assert code_of(resign_hmac, req, cfg, placeholder=PH, real=REAL) == "hmac:config", bad


# --------------------------------------------------------------------------- no secret leaks


def test_no_error_message_or_repr_contains_a_secret():
    errors: list[SigningError] = []

    def collect(fn, *a, **kw):
        try:
            fn(*a, **kw)
        except SigningError as e:
            errors.append(e)

    agent = botocore_sign(**CASES["s3-put-body"], secret=PH)
    # the agent stuffs the secrets everywhere it can
    for v in (f"AWS4-HMAC-SHA256 Credential={PH}/20240501/us-east-1/s3/aws4_request, SignedHeaders=host, "
              f"Signature={REAL}", f"AWS4-HMAC-SHA256 {PH}", f"{REAL} {PH}",
              auth_of(agent).replace("/s3/", f"/{PH}/"), auth_of(agent).replace("host;", f"{PH.lower()};")):
        collect(resign, replace_header(agent, "authorization", v))
    collect(resign, Request(agent.method, agent.url + f"?{PH}={REAL}", agent.headers, agent.body + PH.encode()))
    collect(resign, replace_header(agent, "x-amz-content-sha256", PH))
    collect(resign, replace_header(agent, "x-amz-date", REAL))
    collect(resign, agent, access_key_id=PH)
    collect(resign, agent, now=WHEN + timedelta(days=1))
    collect(resign, Request("GET", f"https://s3.test/?X-Amz-Signature={PH}&X-Amz-Credential={REAL}", [], b""))
    collect(resign_hmac, _hmac_req(sig_value=PH), HCFG, placeholder=PH, real=REAL)
    collect(resign_hmac, _hmac_req(sig_value=base64.b64encode(hashlib.sha256(PH.encode()).digest()).decode()), HCFG,
            placeholder=PH, real=REAL)
    collect(resign_hmac, _hmac_req(), SimpleNamespace(**dict(vars(HCFG), message="{" + PH + "}")), placeholder=PH,
            real=REAL)
    assert len(errors) >= 12
    for e in errors:
        rendered = [str(e), repr(e), e.message, repr(e.args), str(e.to_dict())]
        for text in rendered:
            for secret in (PH, REAL, PH.lower()):
                assert secret not in text, (e.code, text)


# --------------------------------------------------------------------------- Hypothesis

# any code point, lone surrogates included (the default text() strategy leaves them out)
ANY_TEXT = st.text(st.one_of(st.characters(exclude_categories=()), st.sampled_from("\ud800\udcff\r\n\x00%=&/;,")))


_AUTH_PIECES = st.sampled_from([
    "AWS4-HMAC-SHA256 ", "Credential=", f"{AKID}/", "20240501/", "us-east-1/", "sts/", "aws4_request", ", ",
    "SignedHeaders=", "host;", "x-amz-date", ";content-type", "Signature=", GOOD_SIG, ",", "=", "/", ";", " ",
    "\x00", "é", "\ud800",
])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(ANY_TEXT, st.text(max_size=300), st.lists(_AUTH_PIECES, max_size=25).map("".join)))
def test_arbitrary_authorization_raises_only_signing_error(value):
    req = _with_auth_cached(value)
    assert isinstance(sigv4_in_request(req), bool)
    try:
        resign(req)
    except SigningError as e:
        assert e.code.startswith("sigv4:")


_BASE = None


def _base() -> Request:
    """One botocore-signed request, made once (Hypothesis calls us hundreds of times)."""
    global _BASE
    if _BASE is None:
        _BASE = botocore_sign(**CASES["sts-post-form"], secret=PH)
    return _BASE


def _with_auth_cached(value):
    return replace_header(_base(), "authorization", value)


_Q_PIECES = st.sampled_from([
    "X-Amz-Signature=", "X-Amz-Algorithm=AWS4-HMAC-SHA256", "X-Amz-Credential=", f"{AKID}%2F20240501%2F",
    "us-east-1%2Fs3%2Faws4_request", "X-Amz-Date=20240501T120000Z", "X-Amz-Expires=", "600", "99999999999",
    "X-Amz-SignedHeaders=host", GOOD_SIG, "&", "=", "%", "%ZZ", "%FF", "#", "?", "é",
])


@settings(max_examples=300, deadline=None)
@given(st.lists(_Q_PIECES, max_size=30).map("".join),
       st.lists(st.tuples(st.sampled_from(["host", "x-amz-date", "x-amz-content-sha256", "authorization"]) | ANY_TEXT,
                          ANY_TEXT), max_size=4),
       st.binary(max_size=64))
def test_arbitrary_presigned_queries_and_headers_raise_only_signing_error(query, headers, body):
    req = Request("GET", "https://s3.test/b/k?" + query, [("Host", "s3.test")] + headers, body)
    assert isinstance(sigv4_in_request(req), bool)
    try:
        resign(req)
    except SigningError as e:
        assert e.code.startswith("sigv4:")


@settings(max_examples=300, deadline=None)
@given(ANY_TEXT, ANY_TEXT | st.lists(st.sampled_from(["{method}", "{path}", "{body}", "{timestamp}", "{header:x-a}",
                                                       "{header:}", "{{", "}}", "{", "}", "x", "é"])).map("".join),
       ANY_TEXT | st.just("v1={}"), st.binary(max_size=64), ANY_TEXT)
def test_arbitrary_hmac_inputs_raise_only_signing_error(sig_value, template, fmt, body, path):
    cfg = SimpleNamespace(**dict(vars(HCFG), message=template, format=fmt))
    for c in (cfg, HCFG):
        try:
            resign_hmac(_hmac_req(sig_value=sig_value, body=body, path="/" + path), c, placeholder=PH, real=REAL)
        except SigningError as e:
            assert e.code.startswith("hmac:")


@settings(max_examples=300, deadline=None)
@given(ANY_TEXT, ANY_TEXT, st.sampled_from(["", "?X-Amz-Signature=" + GOOD_SIG]))
def test_arbitrary_urls_and_hosts_raise_only_signing_error(authority, host, query):
    agent = _base()
    for url in (f"https://{authority}/{query}", authority + query):
        req = Request(agent.method, url, [("Host", host)] + agent.headers[1:], agent.body)
        assert isinstance(sigv4_in_request(req), bool)
        try:
            resign(req)
        except SigningError as e:
            assert e.code.startswith("sigv4:")
