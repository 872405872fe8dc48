"""--web.config.file on the real exporter: a bad file refused at start in
one line; basic auth applied, changed on file change and on SIGHUP, a bad
file keeping the one in force."""
import signal
import subprocess
import sys

import bcrypt
import pytest
import requests

from procs import ROOT, free_port, wait_for

pytestmark = pytest.mark.e2e

HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()


def test_bad_web_config_refused_at_start(tmp_path):
    web = tmp_path / "web.yml"
    web.write_text("basic_auth_users: {alice: hunter2}\n")
    r = subprocess.run([sys.executable, "-m", "exporter", "--web.config.file", str(web),
                        "--web.listen-address", f"127.0.0.1:{free_port()}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr == ("nettap: web config refused: basic_auth_users.alice: not a bcrypt hash "
                        "(e.g. htpasswd -nBC 10 \"\" | tr -d ':\\n')\n")


def test_web_config_live(tmp_path):
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users: {{grafan2us: '{HASH}'}}\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "nettap.log", "wb")
    p = subprocess.Popen([sys.executable, "-m", "exporter", "--web.config.file", str(web),
                          "--web.listen-address", f"127.0.0.1:{port}"], cwd=ROOT, stdout=log,
                         stderr=subprocess.STDOUT)
    try:
        ok = ("grafan2us", "s3cret")
        wait_for(lambda: requests.get(url + "/readyz", auth=ok, timeout=1).status_code == 200, what="ready")
        assert requests.get(url + "/metrics", timeout=5).status_code == 401
        assert requests.get(url + "/healthz", timeout=5).status_code == 401
        assert requests.get(url + "/metrics", auth=("grafan2us", "nope"), timeout=5).status_code == 401
        # A bad file: refused, the users stay in force.
        web.write_text("basic_auth_users: {grafan2us: plaintext}\n")
        wait_for(lambda: b"web config reload refused" in (tmp_path / "nettap.log").read_bytes(), what="refusal")
        assert requests.get(url + "/metrics", timeout=5).status_code == 401
        assert requests.get(url + "/metrics", auth=ok, timeout=5).status_code == 200
        # A good change applies on its own.
        web.write_text(f"basic_auth_users: {{grafana: '{HASH}'}}\n")
        wait_for(lambda: requests.get(url + "/metrics", auth=("grafana", "s3cret"), timeout=5).status_code == 200,
                 what="new user")
        assert requests.get(url + "/metrics", auth=ok, timeout=5).status_code == 401
        # SIGHUP reloads it too (same size and mtime: only the signal can tell).
        st = web.stat()
        web.write_text(f"basic_auth_users: {{grafan2: '{HASH}'}}\n")
        import os
        os.utime(web, ns=(st.st_atime_ns, st.st_mtime_ns))
        p.send_signal(signal.SIGHUP)
        wait_for(lambda: requests.get(url + "/metrics", auth=("grafan2", "s3cret"), timeout=5).status_code == 200,
                 what="reload on SIGHUP")
        text = (tmp_path / "nettap.log").read_text()
        assert text.count("web config reload refused") == 1 and "hunter2" not in text
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()
