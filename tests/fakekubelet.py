"""A kubelet's GET /pods for tests: a real HTTPS server on loopback that
checks a bearer token and answers a PodList document (or, by mode, slowly,
403, or whatever body is set)."""
from __future__ import annotations

import json
import ssl
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "eyJhbGciOiJSUzI1NiJ9.test-token"


def make_cert(d) -> tuple:
    """(certificate, key) files of a self-signed certificate for 127.0.0.1 in directory d."""
    key, crt = d / "k.pem", d / "c.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", key, "-out", crt, "-days", "1", "-subj", "/CN=node-a",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return str(crt), str(key)


def pod(namespace: str, name: str, uid: str, labels: dict, containers: dict, qos: str = "Burstable") -> dict:
    """One item of a PodList as the kubelet serves it (containers: name -> containerd id)."""
    return {"metadata": {"name": name, "namespace": namespace, "uid": uid, "labels": labels,
                         "resourceVersion": "1", "creationTimestamp": "2026-12-06T18:00:00Z"},
            "spec": {"nodeName": "node-a", "containers": [{"name": n, "image": "busybox"} for n in containers]},
            "status": {"phase": "Running", "qosClass": qos,
                       "containerStatuses": [{"name": n, "ready": True, "restartCount": 0, "image": "busybox",
                                              "state": {"running": {"startedAt": "2026-12-06T18:00:01Z"}},
                                              "containerID": f"containerd://{cid}"} for n, cid in containers.items()]}}


def pod_list(*items) -> bytes:
    return json.dumps({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": list(items)}).encode()


class FakeKubelet(ThreadingHTTPServer):
    """GET /pods over TLS: 401 without the bearer token; else as mode says
    (ok: body; slow: a byte a tenth of a second; forbidden: 403)."""
    daemon_threads = True

    def __init__(self, cert: str, key: str, body: bytes = b""):
        super().__init__(("127.0.0.1", 0), _Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        self.socket = ctx.wrap_socket(self.socket, server_side=True)
        self.mode, self.body, self.requests = "ok", body, 0
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.server_address[1]}/pods"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        srv = self.server
        srv.requests += 1
        if self.path != "/pods" or self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._answer(401, b"Unauthorized")
        if srv.mode == "slow":
            self.send_response(200)
            self.send_header("Content-Length", str(len(srv.body)))
            self.end_headers()
            for b in srv.body[:60]:
                self.wfile.write(bytes([b]))
                self.wfile.flush()
                time.sleep(0.1)
            return None
        if srv.mode == "forbidden":
            return self._answer(403, b"Forbidden (user=system:serviceaccount:nettap:nettap, verb=get, "
                                     b"resource=nodes, subresource=proxy)")
        return self._answer(200, srv.body)

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
