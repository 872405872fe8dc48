"""exporter.web.webconfig and the endpoint under it, with real clients: TLS
with a CA made here by openssl, client certificates (mTLS), basic auth with
bcrypt hashes, the toolkit's headers, reloads keeping the old file on a bad
one."""
from __future__ import annotations

import logging
import os
import socket
import ssl
import subprocess
import time
from pathlib import Path

import bcrypt
import pytest
import requests
from prometheus_client import CollectorRegistry

from exporter.config import quote
from exporter.web import throttle, webconfig
from exporter.config import ConfigError
from exporter.web.server import Limits, serve
from exporter.web.webconfig import Web

HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()     # cost 4: fast tests


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str):
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}", cwd=d)


def _leaf(d: Path, ca: str, name: str, ext: str):
    (d / f"{name}.ext").write_text(ext + "\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """ca signs server and client; other-ca signs intruder."""
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "other-ca")
    _leaf(d, "ca", "server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth")
    _leaf(d, "ca", "client", "extendedKeyUsage=clientAuth")
    _leaf(d, "other-ca", "intruder", "extendedKeyUsage=clientAuth")
    return d


def write(tmp_path, text, name="web.yml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def refused(tmp_path, text) -> str:
    with pytest.raises(ConfigError) as e:
        webconfig.load(write(tmp_path, text))
    assert "\n" not in str(e.value)
    return str(e.value)


# ---- parsing ------------------------------------------------------------------

def test_plain_when_no_tls(tmp_path):
    cfg = webconfig.load(write(tmp_path, "{}\n"))
    assert cfg == webconfig.PLAIN and cfg.describe() == "TLS off; basic auth off"


def test_relative_paths_from_the_files_directory(tmp_path, pki):
    for f in ("server.crt", "server.key"):
        (tmp_path / f).write_bytes((pki / f).read_bytes())
    cfg = webconfig.load(write(tmp_path, "tls_server_config: {cert_file: server.crt, key_file: server.key}\n"))
    assert isinstance(cfg.tls, ssl.SSLContext) and cfg.tls.verify_mode == ssl.CERT_NONE
    assert cfg.tls.minimum_version == ssl.TLSVersion.TLSv1_2


@pytest.mark.parametrize("text, msg", [
    ("tls: {}",
     "web config.tls: unknown key (expected one of tls_server_config, http_server_config, basic_auth_users)"),
    ("rate_limit: {interval: 1s}",
     "web config.rate_limit: not supported by nettap (put a proxy in front for rate limits)"),
    ("tls_server_config: {cert_file: a.crt}", "tls_server_config.key_file: must be a file name, got None"),
    ("tls_server_config: {key_file: a.key}", "tls_server_config.cert_file: must be a file name, got None"),
    ("tls_server_config: {cert_file: a, key_file: b, client_ca_file: ca.crt}",
     "tls_server_config.client_ca_file: a client CA without a client auth policy "
     "(set client_auth_type: RequireAndVerifyClientCert)"),
    ("tls_server_config: {cert_file: a, key_file: b, client_auth_type: RequireAndVerifyClientCert}",
     "tls_server_config.client_ca_file: required with client_auth_type RequireAndVerifyClientCert"),
    ("tls_server_config: {cert_file: a, key_file: b, client_auth_type: RequireAnyClientCert}",
     "tls_server_config.client_auth_type: RequireAnyClientCert (a certificate asked for but not verified) "
     "is not supported by nettap; use RequireAndVerifyClientCert"),
    ("tls_server_config: {cert_file: a, key_file: b, client_auth_type: Always}",
     "tls_server_config.client_auth_type: must be one of NoClientCert, VerifyClientCertIfGiven, "
     "RequireAndVerifyClientCert, got 'Always'"),
    ("tls_server_config: {cert_file: a, key_file: b, min_version: TLS14}",
     "tls_server_config.min_version: must be one of TLS10, TLS11, TLS12, TLS13, got 'TLS14'"),
    ("tls_server_config: {cert_file: a, key_file: b, min_version: TLS13, max_version: TLS12}",
     "tls_server_config: min_version is above max_version"),
    ("tls_server_config: {cipher_suites: [TLS_AES_128_GCM_SHA256]}",
     "tls_server_config.cipher_suites: not supported by nettap (Go cipher suite names; OpenSSL's defaults "
     "apply (TLS 1.2+ by default))"),
    ("http_server_config: {headers: {X-Frame-Options: always}}",
     "http_server_config.headers.X-Frame-Options: must be one of deny, sameorigin, got 'always'"),
    ("http_server_config: {headers: {Server: nettap}}",
     "http_server_config.headers.Server: unknown key (expected one of Strict-Transport-Security, "
     "X-Content-Type-Options, X-Frame-Options, X-XSS-Protection, Content-Security-Policy)"),
    ("http_server_config: {http2: yes please}", "http_server_config.http2: must be true or false, got 'yes please'"),
    ("basic_auth_users: [alice]", "basic_auth_users: must be a mapping of user: bcrypt hash, got list"),
    ("basic_auth_users: {alice: hunter2}",
     "basic_auth_users.alice: not a bcrypt hash (e.g. htpasswd -nBC 10 \"\" | tr -d ':\\n')"),
    ("basic_auth_users: {'a:b': x}", "basic_auth_users: user names are non-empty strings without ':', got 'a:b'"),
])
def test_refused(tmp_path, text, msg):
    assert refused(tmp_path, text) == msg


def test_missing_cert_file_refused(tmp_path):
    msg = refused(tmp_path, "tls_server_config: {cert_file: nope.crt, key_file: nope.key}\n")
    # the path quoted as every refused value is, bounded (a long tmp_path is elided)
    path = quote(str(tmp_path / "nope.crt"))
    assert msg == f"tls_server_config.cert_file: cannot read {path}: No such file or directory"


@pytest.mark.parametrize("which", ["cert_file", "key_file", "client_ca_file"])
def test_a_fifo_in_place_of_a_pem_file_is_refused_without_blocking(tmp_path, pki, which):
    """A FIFO where a certificate, key or CA is expected hung the start and,
    live, the web config watcher inside OpenSSL's open."""
    os.mkfifo(tmp_path / "fifo")
    files = {"cert_file": f"{pki}/server.crt", "key_file": f"{pki}/server.key", "client_ca_file": f"{pki}/ca.crt",
             which: str(tmp_path / "fifo")}
    t = time.monotonic()
    msg = refused(tmp_path, "tls_server_config: {client_auth_type: RequireAndVerifyClientCert, "
                  + ", ".join(f"{k}: {v}" for k, v in files.items()) + "}\n")
    assert time.monotonic() - t < 5
    assert msg == f"tls_server_config.{which}: cannot read '{tmp_path}/fifo': not a regular file", msg


def test_pem_files_are_loaded_from_what_was_read(tmp_path, pki, endpoint):
    """The certificate served is the one read: loaded from memory, not the
    path again."""
    web = Web(webconfig.load(write(tmp_path, f"tls_server_config: {{cert_file: {pki}/server.crt, "
                                             f"key_file: {pki}/server.key}}\n")))
    port = endpoint(web)
    assert get(f"https://127.0.0.1:{port}/healthz", verify=str(pki / "ca.crt")).status_code == 200


def test_key_not_matching_the_cert_refused(tmp_path, pki):
    msg = refused(tmp_path, f"tls_server_config: {{cert_file: {pki}/server.crt, key_file: {pki}/client.key}}\n")
    assert msg.startswith("tls_server_config: cannot load cert_file") and "KEY_VALUES_MISMATCH" in msg


def test_password_hash_never_quoted(tmp_path):
    assert "s3cr" not in refused(tmp_path, "basic_auth_users: {alice: s3cret-plaintext}\n")


def test_empty_file_refused(tmp_path):
    # A truncated file must not switch auth off between an editor's truncate and write.
    assert "the file is empty" in refused(tmp_path, "")


# ---- the endpoint, with real clients ------------------------------------------------

class App:
    registry = CollectorRegistry()

    @staticmethod
    def stats():
        return {}

    @staticmethod
    def not_ready():
        return None


@pytest.fixture
def endpoint():
    servers = []

    def start(web):
        srv = serve("127.0.0.1:0", App.registry, App.stats, App.not_ready, web)
        servers.append(srv)
        return srv.server_address[1]
    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def get(url, **kw):
    s = requests.Session()
    s.trust_env = False
    try:
        return s.get(url, timeout=10, **kw)
    finally:
        s.close()


def tls_file(tmp_path, pki, extra=""):
    return write(tmp_path, f"tls_server_config:\n  cert_file: {pki}/server.crt\n  key_file: {pki}/server.key\n{extra}")


def test_tls(tmp_path, pki, endpoint):
    port = endpoint(Web(webconfig.load(tls_file(tmp_path, pki))))
    r = get(f"https://127.0.0.1:{port}/metrics", verify=str(pki / "ca.crt"))
    assert r.status_code == 200
    with pytest.raises(requests.exceptions.SSLError):
        get(f"https://127.0.0.1:{port}/metrics", verify=str(pki / "other-ca.crt"))
    with pytest.raises(requests.exceptions.ConnectionError):
        get(f"http://127.0.0.1:{port}/metrics")             # plain HTTP: no answer
    assert get(f"https://localhost:{port}/healthz", verify=str(pki / "ca.crt")).text == "ok\n"


def test_tls_metrics_gzip(tmp_path, pki, endpoint):
    import gzip
    port = endpoint(Web(webconfig.load(tls_file(tmp_path, pki))))
    url, ca = f"https://127.0.0.1:{port}/metrics", str(pki / "ca.crt")
    plain = get(url, verify=ca, headers={"Accept-Encoding": "identity"})
    with requests.get(url, verify=ca, headers={"Accept-Encoding": "gzip"}, stream=True, timeout=10) as r:
        assert r.headers["Content-Encoding"] == "gzip"
        assert gzip.decompress(r.raw.read(decode_content=False)) == plain.content
    assert "Content-Encoding" not in plain.headers and b"nettap_http_connections_rejected_total" in plain.content


def test_mtls_requires_a_certificate_from_the_client_ca(tmp_path, pki, endpoint):
    web = Web(webconfig.load(tls_file(tmp_path, pki, f"  client_auth_type: RequireAndVerifyClientCert\n"
                                                     f"  client_ca_file: {pki}/ca.crt\n")))
    assert web.current.describe() == "TLS on, client certificates required; basic auth off"
    port = endpoint(web)
    url, ca = f"https://127.0.0.1:{port}/metrics", str(pki / "ca.crt")
    assert get(url, verify=ca, cert=(str(pki / "client.crt"), str(pki / "client.key"))).status_code == 200
    for cert in (None, (str(pki / "intruder.crt"), str(pki / "intruder.key"))):
        with pytest.raises((requests.exceptions.SSLError, requests.exceptions.ConnectionError)):
            get(url, verify=ca, cert=cert)


def test_basic_auth(tmp_path, endpoint):
    web = Web(webconfig.load(write(tmp_path, f"basic_auth_users:\n  prometheus: '{HASH}'\n")))
    port = endpoint(web)
    base = f"http://127.0.0.1:{port}"
    assert get(base + "/metrics", auth=("prometheus", "s3cret")).status_code == 200
    for auth in (("prometheus", "wrong"), ("nobody", "s3cret"), None):
        r = get(base + "/metrics", auth=auth)
        assert (r.status_code, r.headers["WWW-Authenticate"], r.text) == (401, "Basic", "Unauthorized\n")
    # As the toolkit: every path needs a user, the probes' too.
    for path in ("/healthz", "/readyz", "/", "/stats", "/nope"):
        assert get(base + path).status_code == 401
    assert get(base + "/healthz", auth=("prometheus", "s3cret")).status_code == 200
    assert get(base + "/metrics", headers={"Authorization": "Basic !!!"}).status_code == 401
    assert get(base + "/metrics", headers={"Authorization": "Bearer x"}).status_code == 401


def test_basic_auth_over_mtls(tmp_path, pki, endpoint):
    web = Web(webconfig.load(tls_file(tmp_path, pki, f"  client_auth_type: RequireAndVerifyClientCert\n"
                                                     f"  client_ca_file: {pki}/ca.crt\n"
                                                     f"basic_auth_users: {{prometheus: '{HASH}'}}\n")))
    port = endpoint(web)
    kw = dict(verify=str(pki / "ca.crt"), cert=(str(pki / "client.crt"), str(pki / "client.key")))
    assert get(f"https://127.0.0.1:{port}/metrics", auth=("prometheus", "s3cret"), **kw).status_code == 200
    assert get(f"https://127.0.0.1:{port}/metrics", **kw).status_code == 401


def test_headers_on_every_answer(tmp_path, endpoint):
    web = Web(webconfig.load(write(tmp_path, "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"
                                             "    Content-Security-Policy: ''\n"
                                             f"basic_auth_users: {{p: '{HASH}'}}\n")))
    port = endpoint(web)
    for auth, code in ((("p", "s3cret"), 200), (None, 401)):
        r = get(f"http://127.0.0.1:{port}/metrics", auth=auth)
        assert r.status_code == code and r.headers["X-Frame-Options"] == "deny"
        assert "Content-Security-Policy" not in r.headers          # blank: unset


def test_checks_are_cached(tmp_path):
    web = Web(webconfig.load(write(tmp_path, f"basic_auth_users: {{p: '{HASH}'}}\n")))
    hdr = "Basic " + __import__("base64").b64encode(b"p:s3cret").decode()
    assert web.authorized(web.current, hdr)
    assert len(web._good) == 1 and b"s3cret" not in b"".join(web._good)
    assert web.authorized(web.current, hdr) and len(web._good) == 1


def _basic(user, password):
    return "Basic " + __import__("base64").b64encode(f"{user}:{password}".encode()).decode()


@pytest.fixture
def checks(monkeypatch):
    """The hashes bcrypt.checkpw was asked to check against, in order."""
    seen, real = [], bcrypt.checkpw

    def checkpw(pw, hashed):
        seen.append(hashed)
        return real(pw, hashed)
    monkeypatch.setattr(bcrypt, "checkpw", checkpw)
    return seen


def test_failed_checks_beyond_their_cpu_share_are_throttled_without_hashing(tmp_path, checks, monkeypatch):
    """A flood of wrong passwords spends at most the burst, then a share of
    a core, on bcrypt; beyond it: THROTTLED, no hash computed. A credential
    verified before the flood still passes at once, and no number of
    failures evicts it."""
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(8)).decode()      # ~15 ms a check
    web = Web(webconfig.load(write(tmp_path, f"basic_auth_users: {{p: '{hashed}'}}\n")))
    good = _basic("p", "s3cret")
    assert web.check(web.current, good) == Web.OK
    monkeypatch.setattr(throttle, "FAILED_CPU_SHARE", 0.0)             # no refill: the burst only
    web.throttle._budget = 0.05
    verdicts = [web.check(web.current, _basic(user, f"wrong{i}")) for i in range(2000) for user in ("p", "x")]
    hashed_checks = len(checks) - 1
    assert 1 <= hashed_checks <= 20                                   # 0.05 s of ~15 ms checks, and one over
    assert verdicts[:hashed_checks] == [Web.DENIED] * hashed_checks
    assert set(verdicts[hashed_checks:]) == {Web.THROTTLED}
    assert len(web._bad) == hashed_checks and len(checks) == hashed_checks + 1
    assert web.check(web.current, good) == Web.OK and len(checks) == hashed_checks + 1   # cached, unhashed
    monkeypatch.setattr(throttle, "FAILED_CPU_SHARE", 1000.0)          # refilled: checked again
    assert web.check(web.current, _basic("p", "wrong-again")) == Web.DENIED


def test_throttled_addresses_are_those_that_failed_and_a_new_one_is_checked(tmp_path, checks, monkeypatch):
    """With failed checks' share spent, an address that failed within a
    minute is answered THROTTLED unhashed, but an address with no failure is
    checked: a scraper's credential never verified before gets through a
    flood from elsewhere (a5a072b: THROTTLED for everyone). IPv6 by /64."""
    web = Web(webconfig.load(write(tmp_path, f"basic_auth_users: {{p: '{HASH}'}}\n")))
    monkeypatch.setattr(throttle, "FAILED_CPU_SHARE", 0.0)
    for flooder in ("10.0.0.1", "2001:db8::1"):
        assert web.check(web.current, _basic("p", "no-" + flooder), flooder) == Web.DENIED   # no failure yet: checked
    web.throttle._budget = 0.0
    n = len(checks)
    for flooder in ("10.0.0.1", "::ffff:10.0.0.1", "2001:db8::1", "2001:db8::2"):
        assert web.check(web.current, _basic("p", f"wrong-{flooder}"), flooder) == Web.THROTTLED
        assert web.check(web.current, _basic("p", "s3cret"), flooder) == Web.THROTTLED   # its own address
    assert len(checks) == n                                                  # nothing hashed
    assert web.check(web.current, _basic("p", "s3cret"), "10.0.0.2") == Web.OK        # checked, cached
    assert web.check(web.current, _basic("p", "s3cret"), "10.0.0.1") == Web.OK        # from the cache
    assert web.check(web.current, _basic("p", "wrong"), "2001:db8:0:1::1") == Web.DENIED
    assert len(checks) == n + 2                         # each new address checked once
    assert web.check(web.current, _basic("p", "other"), "2001:db8:0:1::1") == Web.THROTTLED
    monkeypatch.setattr(throttle, "FAILED_FORGET", 0.0)                      # forgotten: checked again
    assert web.check(web.current, _basic("p", "other"), "10.0.0.1") == Web.DENIED


def test_one_check_at_a_time_one_per_address_and_new_addresses_first(tmp_path, monkeypatch):
    """While a check runs, another from the same address is THROTTLED at
    once; others wait for their turn, addresses without a failure first."""
    import threading
    web = Web(webconfig.load(write(tmp_path, f"basic_auth_users: {{p: '{HASH}'}}\n")))
    assert web.check(web.current, _basic("p", "wrong"), "10.0.0.5") == Web.DENIED   # 10.0.0.5 has failed
    gate, order, real = threading.Event(), [], bcrypt.checkpw

    def checkpw(pw, hashed):
        order.append(pw)
        if pw == b"first":
            gate.wait(10)
        return real(pw, hashed)
    monkeypatch.setattr(bcrypt, "checkpw", checkpw)
    verdicts = {}

    def ask(password, client):
        verdicts[password] = web.check(web.current, _basic("p", password), client)
    first = threading.Thread(target=ask, args=("first", "10.0.0.1"))
    first.start()
    while order != [b"first"]:
        time.sleep(0.001)
    assert web.check(web.current, _basic("p", "again"), "10.0.0.1") == Web.THROTTLED   # its check runs
    waiting = [threading.Thread(target=ask, args=a) for a in (("late", "10.0.0.5"), ("s3cret", "10.0.0.2"))]
    for t in waiting:
        t.start()
        time.sleep(0.05)                                # late waits first
    gate.set()
    for t in [first] + waiting:
        t.join(10)
    assert order == [b"first", b"s3cret", b"late"]
    assert verdicts == {"first": Web.DENIED, "s3cret": Web.OK, "late": Web.DENIED}


@pytest.mark.parametrize("cost", [5, 12])
def test_an_unknown_user_costs_what_the_configured_users_cost(tmp_path, checks, cost):
    """Timing must not tell an unknown user from a known one whatever the
    configured cost (a fixed cost-10 hash did: cost 5, 2 vs 63 ms)."""
    # the hash of cost 12 is not computed here: only its cost is read before a check
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(cost)).decode() if cost < 12 else \
        "$2b$12$" + "a" * 53
    web = Web(webconfig.load(write(tmp_path, f"basic_auth_users: {{p: '{hashed}', q: '{hashed}'}}\n")))
    if cost == 12:                      # a cost-12 check takes ~0.25 s: count it, do not run it
        checks.clear()
    assert web.check(web.current, _basic("nobody", "x")) == Web.DENIED
    assert webconfig._cost(checks[-1]) == cost and checks[-1] != hashed.encode()


def test_a_refused_or_throttled_request_ends_its_connection_and_is_counted(tmp_path, endpoint):
    """Requests pipelined behind a refused one get no check of their own:
    the answer carries Connection: close and the connection ends."""
    web = Web(webconfig.load(write(tmp_path, f"basic_auth_users: {{p: '{HASH}'}}\n")))
    port = endpoint(web)
    req = f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: {_basic('p', 'wrong')}\r\n\r\n".encode()
    for budget, code in ((1.0, b"401"), (-1.0, b"429")):
        web.throttle._budget, web._bad = budget, {}
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(req * 20)
            got = b""
            while chunk := c.recv(65536):
                got += chunk
        assert got.count(b"HTTP/1.1 ") == 1 and got.startswith(b"HTTP/1.1 " + code), got
        assert b"Connection: close" in got
        if code == b"429":
            assert b"Retry-After: 1" in got
    from exporter.web.server import _COLLECTORS
    srv, = (s for s in _COLLECTORS[App.registry].servers if s.server_address[1] == port)
    assert srv.rejected["unauthorized"] == 1 and srv.rejected["auth_throttled"] == 1


def test_reload_applies_and_a_bad_file_keeps_the_old(tmp_path, endpoint, caplog):
    path = write(tmp_path, f"basic_auth_users: {{p: '{HASH}'}}\n")
    web = Web(webconfig.load(path), path)
    port = endpoint(web)
    url = f"http://127.0.0.1:{port}/metrics"
    assert get(url).status_code == 401
    write(tmp_path, "basic_auth_users: {p: not-a-hash}\n")
    with caplog.at_level(logging.INFO, logger="exporter.web.webconfig"):
        assert not web.reload()
    assert caplog.records[-1].getMessage() == (
        "web config reload refused, previous web config stays in force: basic_auth_users.p: not a bcrypt hash "
        "(e.g. htpasswd -nBC 10 \"\" | tr -d ':\\n')")
    assert get(url).status_code == 401 and get(url, auth=("p", "s3cret")).status_code == 200
    write(tmp_path, "{}\n")
    with caplog.at_level(logging.INFO, logger="exporter.web.webconfig"):
        assert web.reload()
    assert caplog.records[-1].getMessage() == f"web config loaded from {path}: TLS off; basic auth off"
    assert get(url).status_code == 200


def test_reload_switches_to_tls(tmp_path, pki, endpoint):
    path = write(tmp_path, "{}\n")
    web = Web(webconfig.load(path), path)
    port = endpoint(web)
    assert get(f"http://127.0.0.1:{port}/metrics").status_code == 200
    tls_file(tmp_path, pki)
    assert web.reload()
    assert get(f"https://127.0.0.1:{port}/metrics", verify=str(pki / "ca.crt")).status_code == 200


def test_documented_example_is_accepted(tmp_path, pki):
    """docs/endpoint.md's example web config, with its files made here: accepted
    as written (the toolkit's format), and its hash is a real bcrypt hash."""
    import re
    doc = (Path(__file__).resolve().parents[2] / "docs" / "endpoint.md").read_text()
    example = re.search(r"```yaml\n# /etc/nettap/web.yml\n(.*?)```", doc, re.S)[1]
    for name, src in (("nettap.crt", "server.crt"), ("nettap.key", "server.key"), ("scrapers-ca.crt", "ca.crt")):
        (tmp_path / name).write_bytes((pki / src).read_bytes())
    cfg = webconfig.load(write(tmp_path, example))
    assert cfg.describe() == "TLS on, client certificates required; basic auth on (1 user)"
    assert cfg.headers == (("X-Content-Type-Options", "nosniff"), ("X-Frame-Options", "deny"))


def test_tls_keep_alive_and_pipelining(tmp_path, pki, endpoint):
    """Over TLS a connection goes back to waiting between requests: bytes
    already decrypted (pipelined requests) are answered without new ones."""
    port = endpoint(Web(webconfig.load(tls_file(tmp_path, pki))))
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    req = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                         server_hostname="localhost") as s:
        f = s.makefile("rb")

        def answer() -> bytes:
            status = f.readline()
            while f.readline() != b"\r\n":
                pass
            return status + f.read(3)
        s.sendall(req * 3)
        assert [answer() for _ in range(3)] == [b"HTTP/1.1 200 OK\r\nok\n"] * 3
        time.sleep(0.2)                  # waiting again, then one more
        s.sendall(req)
        assert answer() == b"HTTP/1.1 200 OK\r\nok\n"


def test_tls_clients_that_never_handshake_hold_no_worker(tmp_path, pki):
    web = Web(webconfig.load(tls_file(tmp_path, pki)))
    srv = serve("127.0.0.1:0", App.registry, App.stats, App.not_ready, web, limits=Limits(workers=1))
    mute = [socket.create_connection(srv.server_address, timeout=10) for _ in range(20)]
    try:
        r = get(f"https://localhost:{srv.server_address[1]}/healthz", verify=str(pki / "ca.crt"))
        assert r.text == "ok\n"
    finally:
        for s in mute:
            s.close()
        srv.shutdown()
        srv.server_close()


def _served_cn(port, ca):
    ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as s:
        return dict(x[0] for x in s.getpeercert()["subject"])["commonName"]


def test_a_certificate_rotated_in_place_is_served_without_sighup(tmp_path, pki, endpoint, caplog):
    """cert-manager style: the certificate and key replaced where they are;
    the watcher sees the files the web config in force names, and a bad
    pair keeps the old one in force."""
    import shutil
    from exporter.util.watcher import ConfigWatcher
    _leaf(pki, "ca", "rotated", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth")
    d = tmp_path / "tls"
    d.mkdir()
    shutil.copy(pki / "server.crt", d / "tls.crt")
    shutil.copy(pki / "server.key", d / "tls.key")
    path = write(tmp_path, "tls_server_config: {cert_file: tls/tls.crt, key_file: tls/tls.key}\n")
    web = Web(webconfig.load(path), path)
    w = ConfigWatcher(path, web.reload, interval=0.05, also=lambda: web.current.files).start()
    try:
        port = endpoint(web)
        assert _served_cn(port, pki / "ca.crt") == "server"
        for name in ("tls.key", "tls.crt"):               # as a Secret volume swaps them: by rename
            shutil.copy(pki / name.replace("tls", "rotated"), d / (name + ".new"))
            os.replace(d / (name + ".new"), d / name)
        end = time.monotonic() + 10
        while _served_cn(port, pki / "ca.crt") != "rotated":
            assert time.monotonic() < end, "the rotated certificate was not served"
            time.sleep(0.05)
        with caplog.at_level(logging.INFO, logger="exporter.web.webconfig"):
            (d / "tls.key").write_text("not a key\n")        # a bad pair: the rotated one stays
            end = time.monotonic() + 10
            while not any("reload refused" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < end, "the bad key was not noticed"
                time.sleep(0.05)
        assert _served_cn(port, pki / "ca.crt") == "rotated"
    finally:
        w.stop()
