"""The NATS test harness (tests/natscluster.py) against the real nats-server:
a cluster starts healthy; an R3 stream de-duplicates by Nats-Msg-Id and
fails over when its leader is killed; each client auth method connects and
a wrong credential fails at once; no node outlives its test."""
from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections import Counter
from pathlib import Path

import nats
import pytest
import requests
from nats.js.api import StorageType
from nats.js.errors import NoStreamResponseError

from natscluster import NATS_SERVER, NatsCluster, make_nkey, make_tls

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(NATS_SERVER is None, reason="nats-server is not on PATH "
                                 "(scripts/setup.sh test installs Debian's nats-server)")]


def _left_behind(tmp: Path) -> list:
    """Live processes whose command line names tmp (a node's config lives there)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(tmp).encode() in f.read():
                    out.append(int(pid))
        except OSError:
            pass
    return out


def _all_gone(c: NatsCluster, tmp: Path) -> None:
    assert c.procs and all(p.returncode is not None for p in c.procs), "a node was not reaped"
    assert not _left_behind(tmp)


@pytest.fixture
def cluster(tmp_path):
    with NatsCluster(tmp_path) as c:
        yield c
    _all_gone(c, tmp_path)


async def _connect(servers, **kw):
    """One attempt, no reconnects: a refusal raises within seconds."""
    return await asyncio.wait_for(nats.connect(servers, allow_reconnect=False, max_reconnect_attempts=1,
                                               connect_timeout=2, **kw), 10)


def test_three_nodes_start_healthy(cluster):
    names = []
    for i in range(3):
        assert requests.get(cluster.monitor(i) + "/healthz", timeout=2).status_code == 200
        names.append(requests.get(cluster.monitor(i) + "/varz", timeout=2).json()["server_name"])
        meta = requests.get(cluster.monitor(i) + "/jsz", timeout=2).json()["meta_cluster"]
        assert meta["cluster_size"] == 3 and meta["leader"] in ("n1", "n2", "n3"), meta
        assert requests.get(cluster.monitor(i) + "/routez", timeout=2).json()["num_routes"] == 2
    assert names == ["n1", "n2", "n3"]
    assert all(u.startswith("nats://127.0.0.1:") for u in cluster.urls) and len(set(cluster.urls)) == 3
    with pytest.raises(TimeoutError, match=r"(?s)a leader of stream NOPE.*--- n3 log .*Server is ready"):
        cluster.stream_leader("NOPE", timeout=0.2)


def test_one_node_runs_standalone(tmp_path):
    async def r1():
        nc = await _connect(c.urls)
        try:
            await nc.jetstream().add_stream(name="S", subjects=["s.>"], num_replicas=1)
        finally:
            await nc.close()
    with NatsCluster(tmp_path, n=1) as c:
        assert len(c.urls) == 1 and "cluster" not in c.log(0).lower()
        asyncio.run(r1())
        assert c.stream_leader("S") == 0
    _all_gone(c, tmp_path)


async def _publish_until_stored(js, subject: str, msg_id: str, deadline: float):
    """Publish until acked; the retryable errors of an election (no leader:
    503, leader lost mid-request: timeout, connection to it lost) until deadline."""
    seen: Counter = Counter()
    while True:
        try:
            return await js.publish(subject, msg_id.encode(), headers={"Nats-Msg-Id": msg_id}), dict(seen)
        except (NoStreamResponseError, nats.errors.TimeoutError, nats.errors.ConnectionReconnectingError) as e:
            seen[type(e).__name__] += 1
            if time.monotonic() > deadline:
                raise AssertionError(f"no ack by the deadline; errors: {seen}") from e
            await asyncio.sleep(0.1)


def test_r3_stream_dedups_and_fails_over(cluster):
    async def scenario():
        nc = await nats.connect(cluster.urls, connect_timeout=2, reconnect_time_wait=0.2)
        try:
            js = nc.jetstream(timeout=2)
            await js.add_stream(name="T", subjects=["t.>"], storage=StorageType.FILE, num_replicas=3)
            first = await js.publish("t.a", b"m1", headers={"Nats-Msg-Id": "m1"})
            again = await js.publish("t.a", b"m1", headers={"Nats-Msg-Id": "m1"})
            assert not first.duplicate and again.duplicate and again.seq == first.seq

            old = await asyncio.to_thread(cluster.stream_leader, "T")
            assert (await js.stream_info("T")).cluster.leader == f"n{old + 1}"
            await asyncio.to_thread(cluster.kill, old)
            t0 = time.monotonic()
            second, errors = await _publish_until_stored(js, "t.b", "m2", t0 + 30)
            outage = time.monotonic() - t0
            new = await asyncio.to_thread(cluster.stream_leader, "T")
            # a timed-out try may have been stored after all: then the ack is its duplicate, same seq
            assert new != old and second.seq == first.seq + 1
            assert (await js.publish("t.a", b"m1", headers={"Nats-Msg-Id": "m1"})).duplicate

            t0 = time.monotonic()
            await asyncio.to_thread(cluster.start_node, old)
            print(f"leader n{old + 1} killed: acks again on n{new + 1} after {outage:.1f} s ({errors}); "
                  f"restarted healthy in {time.monotonic() - t0:.1f} s")
            assert (await js.stream_info("T")).state.messages == 2
        finally:
            await nc.close()
    asyncio.run(scenario())
    assert len(cluster.procs) == 4


def _auth_case(tmp: Path, method: str):
    """(server auth option, good client kwargs, wrong client kwargs) for method."""
    if method == "password":
        return {"user": "nettap", "password": "s3cret"}, {"user": "nettap", "password": "s3cret"}, \
            {"user": "nettap", "password": "wrong"}
    if method == "token":
        return {"token": "tok-123"}, {"token": "tok-123"}, {"token": "tok-124"}
    seed, public = make_nkey(tmp)
    other, _ = make_nkey(tmp, "other")
    return {"nkey": public}, {"nkeys_seed": str(seed)}, {"nkeys_seed": str(other)}


@pytest.mark.parametrize("method", ["password", "token", "nkey"])
def test_auth_connects_and_a_wrong_credential_fails_fast(tmp_path, method):
    server, good, wrong = _auth_case(tmp_path, method)

    async def attempts():
        nc = await _connect(c.urls, **good)
        try:
            assert (await nc.jetstream().account_info()).limits is not None     # JetStream for this user
        finally:
            await nc.close()
        t0 = time.monotonic()
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await _connect(c.urls, **wrong)
        assert time.monotonic() - t0 < 3
    with NatsCluster(tmp_path, n=1, auth=server) as c:
        asyncio.run(attempts())
    _all_gone(c, tmp_path)


def test_tls_with_a_private_ca(tmp_path):
    pki = make_tls(tmp_path / "pki")

    async def attempts():
        nc = await _connect(c.urls, tls=pki.client_context(), user="nettap", password="s3cret")
        try:
            await nc.jetstream().account_info()
        finally:
            await nc.close()
        # verify: true wants a client certificate. TLS 1.3 refuses it after the client's handshake
        # is done: the client sees the alert (SSLError) or, as often, the connection already gone
        # (a reset, or a broken pipe on its CONNECT): the server's log says which it was.
        with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
            await _connect(c.urls, tls=pki.client_context(cert=False), user="nettap", password="s3cret")
        assert any("client didn't provide a certificate" in c.log(i) for i in range(2))
        with pytest.raises(ssl.SSLCertVerificationError):   # the system's CAs do not know ours
            await _connect(c.urls, tls=ssl.create_default_context(), user="nettap", password="s3cret")
    with NatsCluster(tmp_path, n=2, auth={"user": "nettap", "password": "s3cret"}, tls=pki.server(verify=True)) as c:
        assert all(u.startswith("tls://127.0.0.1:") for u in c.urls)
        asyncio.run(attempts())
    _all_gone(c, tmp_path)


def test_a_node_that_cannot_start_fails_with_its_log(tmp_path):
    tls = {"cert_file": tmp_path / "missing.pem", "key_file": tmp_path / "missing.key"}
    c = NatsCluster(tmp_path, n=2, tls=tls)
    with pytest.raises(RuntimeError, match=r"(?s)n[12] exited with 1 .*missing\.pem"):   # either may be first
        with c:
            pass
    _all_gone(c, tmp_path)


def test_stop_and_close_reap_every_node(tmp_path):
    c = NatsCluster(tmp_path, n=3)
    with c:
        assert c.stop(0) in (0, 1)                          # 2.9 exits 1 even after a graceful shutdown
        assert c.log(0).rstrip().endswith("Server Exiting..")
        c.wait_healthy()                                    # the two left keep a meta leader
        c.start_node(0)
        assert c.kill(2) == -9
        assert not c.running(2) and c.running(0)
    assert len(c.procs) == 4
    _all_gone(c, tmp_path)
