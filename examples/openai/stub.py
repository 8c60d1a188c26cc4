#!/usr/bin/env python3
"""A local OpenAI-compatible stub for the credentials demo: HTTPS on 127.0.0.1 with a CA it
makes itself; answers /v1/chat/completions only when it receives the REAL key (argv[3]), and
prints what Authorization it saw. Usage: stub.py CA_DIR PORT_FILE REAL_KEY"""

import datetime
import http.server
import json
import ssl
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

ca_dir, port_file, real = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
now = datetime.datetime.now(datetime.timezone.utc)
key = ec.generate_private_key(ec.SECP256R1())
name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "openai stub CA")])
ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
      .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
      .not_valid_after(now + datetime.timedelta(days=1))
      .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
      .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
      .sign(key, hashes.SHA256()))
leaf_key = ec.generate_private_key(ec.SECP256R1())
leaf = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "api.stub.test")]))
        .issuer_name(name).public_key(leaf_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("api.stub.test")]), critical=False)
        .sign(key, hashes.SHA256()))
ca_dir.mkdir(parents=True, exist_ok=True)
(ca_dir / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
(ca_dir / "leaf.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
(ca_dir / "leaf.key").write_bytes(leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))


class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        got = self.headers.get("Authorization", "")
        ok = got == f"Bearer {real}"
        print(f"stub: Authorization {'is the REAL key' if ok else 'is NOT the real key'}", flush=True)
        body = {"id": "chatcmpl-demo", "object": "chat.completion", "created": 1, "model": "stub",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "hello from the stub (it saw the real key)"}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}} if ok else \
               {"error": {"message": "invalid api key", "type": "invalid_request_error"}}
        data = json.dumps(body).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(str(ca_dir / "leaf.pem"), str(ca_dir / "leaf.key"))
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
port_file.write_text(str(srv.server_address[1]))
srv.serve_forever()
