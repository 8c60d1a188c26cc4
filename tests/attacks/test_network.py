"""Network isolation: the sandbox has its own empty network namespace (loopback only).

Traffic is only ever sent to loopback addresses, plus one connect to 192.0.2.1 (TEST-NET-1,
documentation range, never routable) to show that no route exists at all."""

from __future__ import annotations

import socket
import time

import pytest

from _attacklib import dump, needs_root, parse_table

pytestmark = [pytest.mark.attack, needs_root]




SOCKETS = r"""
import socket, errno
def t(name, *args):
    try:
        s = socket.socket(*args); print(name, "OK"); s.close()
    except OSError as e:
        print(name, errno.errorcode[e.errno])
t("raw_icmp", socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
t("raw_tcp", socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
t("raw_raw", socket.AF_INET, socket.SOCK_RAW, 255)
t("raw6_icmp", socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
t("raw_cloexec", socket.AF_INET, socket.SOCK_RAW | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK, socket.IPPROTO_ICMP)
t("inet_packet", socket.AF_INET, 10, 0)
t("packet_raw", socket.AF_PACKET, socket.SOCK_RAW, 0x0300)
t("packet_dgram", socket.AF_PACKET, socket.SOCK_DGRAM, 0x0300)
t("netlink_audit", socket.AF_NETLINK, socket.SOCK_RAW, 9)
t("netlink_uevent", socket.AF_NETLINK, socket.SOCK_DGRAM, 15)
t("netlink_netfilter", socket.AF_NETLINK, socket.SOCK_RAW, 12)
t("netlink_xfrm", socket.AF_NETLINK, socket.SOCK_RAW, 6)
t("netlink_sock_diag", socket.AF_NETLINK, socket.SOCK_RAW, 4)
t("netlink_generic", socket.AF_NETLINK, socket.SOCK_RAW, 16)
t("af_key", socket.AF_KEY, socket.SOCK_RAW, 2)
t("af_vsock", 40, socket.SOCK_STREAM, 0)
t("CONTROL_netlink_route", socket.AF_NETLINK, socket.SOCK_RAW, 0)
t("CONTROL_tcp", socket.AF_INET, socket.SOCK_STREAM, 0)
t("CONTROL_udp6", socket.AF_INET6, socket.SOCK_DGRAM, 0)
t("CONTROL_icmp_dgram", socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
"""


def test_raw_packet_and_netlink_sockets_fail(py):
    r = py(SOCKETS)
    assert r.returncode == 0, dump(r)
    res = parse_table(r.stdout)
    assert res["CONTROL_netlink_route"] == ["OK"], dump(r)  # positive control: routing netlink works
    assert res["CONTROL_tcp"] == ["OK"] and res["CONTROL_udp6"] == ["OK"], dump(r)
    for k in ("raw_icmp", "raw_tcp", "raw_raw", "raw6_icmp", "raw_cloexec", "inet_packet", "packet_raw",
              "packet_dgram", "netlink_audit", "netlink_uevent", "netlink_netfilter", "netlink_xfrm",
              "netlink_sock_diag", "netlink_generic", "af_key", "af_vsock"):
        assert res.get(k) != ["OK"], f"socket {k} could be created" + dump(r)
    for k in ("raw_icmp", "packet_raw", "netlink_audit", "netlink_uevent"):
        assert res[k] == ["EPERM"], f"{k}: {res[k]}" + dump(r)


def test_only_loopback_interface(py):
    code = r"""
import socket, os, subprocess
print("IFNAMES", sorted(n for _, n in socket.if_nameindex()))
devs = [ln.split(":")[0].strip() for ln in open("/proc/net/dev").read().splitlines()[2:]]
print("PROCNETDEV", sorted(devs))
print("SYSCLASSNET", sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else "absent")
print("ROUTE4", [ln.split()[0] for ln in open("/proc/net/route").read().splitlines()[1:]])
print("ROUTE6", sorted({ln.split()[-1] for ln in open("/proc/net/ipv6_route").read().splitlines()}))
if os.path.exists("/usr/bin/ip") or os.path.exists("/usr/sbin/ip"):
    r = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True)
    print("IPLINKS", sorted(l.split(":")[1].strip() for l in r.stdout.splitlines()))
    r = subprocess.run(["ip", "route", "show", "table", "all"], capture_output=True, text=True)
    print("IPROUTES", [l for l in r.stdout.splitlines() if not l.startswith(("local", "broadcast", "multicast", "anycast", "fe80"))
                        and " lo " not in l + " "])
"""
    r = py(code)
    assert r.returncode == 0, dump(r)
    assert "IFNAMES ['lo']" in r.stdout, dump(r)
    assert "PROCNETDEV ['lo']" in r.stdout, dump(r)
    assert "SYSCLASSNET absent" in r.stdout or "SYSCLASSNET ['lo']" in r.stdout, dump(r)
    assert "ROUTE4 []" in r.stdout, "an IPv4 route exists inside" + dump(r)
    assert "ROUTE6 ['lo']" in r.stdout or "ROUTE6 []" in r.stdout, dump(r)
    if "IPLINKS" in r.stdout:
        assert "IPLINKS ['lo']" in r.stdout and "IPROUTES []" in r.stdout, dump(r)


def _host_listener(family=socket.AF_INET, addr="127.0.0.1"):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, 0))
    s.listen(16)
    s.setblocking(False)
    return s


CONNECT = r"""
import socket, errno, sys
fam = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
s = socket.socket(fam, socket.SOCK_STREAM); s.settimeout(3)
try:
    s.connect((sys.argv[1], int(sys.argv[2]))); print("CONNECTED"); s.sendall(b"exfil")
except OSError as e:
    print("connect", errno.errorcode.get(e.errno, e))
"""


@pytest.mark.parametrize("family,addr", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_tcp_to_host_loopback_listener_fails(agentvm, family, addr):
    srv = _host_listener(family, addr)
    port = srv.getsockname()[1]
    try:
        # positive control: the host listener accepts from the host
        c = socket.create_connection((addr, port), timeout=2)
        time.sleep(0.05)
        conn, _ = srv.accept()
        conn.close()
        c.close()
        r = agentvm("run", "--", "/usr/bin/python3", "-c", CONNECT, addr, str(port))
        out = r.stdout.decode()
        assert "CONNECTED" not in out, f"the sandbox reached the host's {addr}:{port}" + dump(r)
        assert "connect E" in out, dump(r)
        with pytest.raises(BlockingIOError):
            srv.accept()  # the listener never saw a connection
    finally:
        srv.close()


@pytest.mark.parametrize("family,addr", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_udp_to_host_loopback_never_arrives(agentvm, family, addr):
    u = socket.socket(family, socket.SOCK_DGRAM)
    u.bind((addr, 0))
    u.setblocking(False)
    port = u.getsockname()[1]
    try:
        # positive control: a datagram from the host arrives
        h = socket.socket(family, socket.SOCK_DGRAM)
        h.sendto(b"control", (addr, port))
        time.sleep(0.05)
        assert u.recv(64) == b"control"
        h.close()
        code = (
            "import socket, sys\n"
            f"s = socket.socket({int(family)}, socket.SOCK_DGRAM)\n"
            "for i in range(20):\n"
            "    try:\n"
            f"        s.sendto(b'exfil-%d' % i, ({addr!r}, {port}))\n"
            "    except OSError as e:\n"
            "        print('send', e); break\n"
            "print('done')\n"
        )
        r = agentvm("run", "--", "/usr/bin/python3", "-c", code)
        assert b"done" in r.stdout, dump(r)
        time.sleep(0.1)
        with pytest.raises(BlockingIOError):
            data = u.recv(64)
            pytest.fail(f"a datagram from the sandbox reached the host: {data!r}")
    finally:
        u.close()


NOROUTE = r"""
import socket, errno
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    u.connect(("192.0.2.1", 9)); print("udp CONNECTED")
except OSError as e:
    print("udp", errno.errorcode[e.errno])
t = socket.socket(socket.AF_INET, socket.SOCK_STREAM); t.settimeout(2)
try:
    t.connect(("192.0.2.1", 80)); print("tcp CONNECTED")
except OSError as e:
    print("tcp", errno.errorcode.get(e.errno, str(e)))
"""


def test_no_route_to_outside(py):
    """192.0.2.1 is TEST-NET-1 (never routable); the only non-loopback address used here."""
    r = py(NOROUTE)
    res = parse_table(r.stdout)
    # UDP connect only does the route lookup: an empty netns has no route at all
    assert res.get("udp") == ["ENETUNREACH"], dump(r)
    # TCP: Landlock (no allowed port) answers EACCES before routing, or the route lookup fails
    assert res.get("tcp") in (["ENETUNREACH"], ["EACCES"]), dump(r)


def test_no_dns_resolver(py):
    code = r"""
import socket
print("RESOLV", repr(open("/etc/resolv.conf").read()))
for name in ("example.com", "pypi.org", "metadata.google.internal", "169.254.169.254.nip.io"):
    try:
        print("RESOLVED", name, socket.getaddrinfo(name, 443))
    except socket.gaierror as e:
        print("gaierror", name, e.errno)
print("CONTROL_localhost", socket.getaddrinfo("localhost", 80, socket.AF_INET)[0][4][0])
"""
    r = py(code)
    assert r.returncode == 0, dump(r)
    resolv = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESOLV "))
    assert "nameserver" not in resolv, dump(r)
    assert "RESOLVED" not in r.stdout, dump(r)
    assert r.stdout.count("gaierror") == 4, dump(r)
    assert "CONTROL_localhost 127.0.0.1" in r.stdout, dump(r)


LOOPBACK_SERVERS = r"""
import errno, socket, sys, threading
def serve(family, addr, port):
    s = socket.socket(family)
    try:
        s.bind((addr, port)); s.listen()
    except OSError as e:
        print("bind", addr, port, errno.errorcode.get(e.errno, e)); return None
    port = s.getsockname()[1]
    def one():
        c, _ = s.accept(); c.sendall(b"pong:" + c.recv(64)); c.close()
    threading.Thread(target=one, daemon=True).start()
    c = socket.create_connection((addr, port), timeout=3); c.sendall(b"ping"); got = c.recv(64); c.close()
    print("served", addr, "fixed" if port == 8000 else "ephemeral", got.decode(), port)
    return s
keep = [serve(socket.AF_INET, "127.0.0.1", 0), serve(socket.AF_INET6, "::1", 0), serve(socket.AF_INET, "127.0.0.1", 8000)]
try:  # the gate's relay keeps its port
    r = socket.socket(); r.bind(("127.0.0.1", 3128)); print("relay-port TAKEN")
except OSError as e:
    print("relay-port", errno.errorcode.get(e.errno, e))
print("LISTENING", flush=True)
sys.stdin.readline()  # the host probes the ports meanwhile
"""


def test_servers_on_the_sandbox_loopback_work_and_stay_inside(avm_home):
    """Any port on the sandbox's own loopback (v4 and v6, ephemeral and fixed) can be bound
    and reached from inside, as on a normal machine; the gate's relay port cannot be taken;
    and the host's loopback never reaches those servers (the network namespace is private)."""
    import subprocess

    from tests.helpers import agentvm_cmd

    p = subprocess.Popen(agentvm_cmd() + ["run", "--allow", "example.test", "--", "/usr/bin/python3", "-c",
                                          LOOPBACK_SERVERS],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line.strip())
            if line.startswith("LISTENING"):
                break
        served = [ln.split() for ln in lines if ln.startswith("served")]
        assert len(served) == 3 and all(x[3] == "pong:ping" for x in served), lines
        assert "relay-port EADDRINUSE" in lines, lines
        # from the host, none of the sandbox's ports answer on the host's loopback
        for _, addr, _, _, port in served:
            fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
            s = socket.socket(fam)
            s.settimeout(1)
            try:
                rc = s.connect_ex((addr, int(port)))
            finally:
                s.close()
            assert rc != 0 or int(port) == 8000 and _host_port_in_use(8000), f"the host reached the sandbox's {addr}:{port}"
    finally:
        try:
            p.stdin.write("\n")
            p.stdin.flush()
        except OSError:
            pass
        p.wait(30)


def _host_port_in_use(port: int) -> bool:
    """Something of the host's own listens there (then a connect proves nothing)."""
    return any(f":{port:04X} " in ln and ln.split()[3] == "0A" for f in ("/proc/net/tcp", "/proc/net/tcp6")
               for ln in open(f).read().splitlines()[1:])


def test_declared_local_ports_are_an_explicit_tcp_restriction(agentvm, tmp_path):
    """`security.localPorts` asks Landlock to restrict TCP: only those ports (and the gate's
    relay) can be bound or connected to; UDP (not handled by Landlock) works as a control."""
    f = tmp_path / "ports.yaml"
    f.write_text("apiVersion: agentvm/v1\nkind: Agent\nmetadata: {name: ports}\nspec:\n"
                 "  workspace: {enabled: false}\n  security: {localPorts: [18081]}\n")
    code = r"""
import socket, errno
for port in (18080, 18081):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port)); s.listen(); print("tcp_bind_%d OK" % port)
    except OSError as e:
        print("tcp_bind_%d" % port, errno.errorcode[e.errno])
c = socket.socket()
try:
    c.connect(("127.0.0.1", 18080)); print("tcp_connect OK")
except OSError as e:
    print("tcp_connect", errno.errorcode[e.errno])
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("127.0.0.1", 18080)); print("CONTROL_udp_bind OK")
"""
    r = agentvm("run", "-f", str(f), "--", "/usr/bin/python3", "-c", code)
    res = parse_table(r.stdout.decode())
    assert res.get("CONTROL_udp_bind") == ["OK"], dump(r)
    assert res.get("tcp_bind_18081") == ["OK"], dump(r)
    assert res.get("tcp_bind_18080") == ["EACCES"], dump(r)
    assert res.get("tcp_connect") == ["EACCES"], dump(r)
