"""What a TLS call costs its process with nettap's uprobes (probe_cost.py's
TLS section), for Go's crypto/tls and for OpenSSL's libssl the same way: a
client sends n messages of 64 B, one write call each (Go: (*Conn).Write;
Python: SSL_write_ex), to a Go server that drops them, and times each call
with its own clock (median and mean ns per call). Per variant, in rounds,
the cases of a round one after another (their order turned each round):

  no uprobe           nettap running, the client not a target, no TLS uprobe
  empty uprobes       the same, and programs that return at once where
                      nettap's go: Go, the entry of crypto/tls.(*Conn).Write
                      and each of its RETs (goelf.inspect); OpenSSL, the
                      entry and return of SSL_write_ex (the bare trap)
  not captured        capture.tls on, tls_attach: targets, the target a
                      process of ANOTHER copy of the Go binary (it maps no
                      libssl): the client's file has no uprobe
  captured, TLS off   the client's pid the target, capture.tls off (what
                      capturing its TCP connection costs, ciphertext)
  captured            the same with capture.tls on: nettap's programs

The server and the decoy target run copies of their own of the Go binary
(a uprobe belongs to a file): neither is ever trapped. Per-program ns per
run from the kernel's BPF statistics, beside the empty programs'.

Run as root:  .venv/bin/python bench/probe_cost.py --sections tls [--tls-calls 8000] [--tls-rounds 15]
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from exporter import config
from exporter.kernel import goelf, gotls, libbpf, loader, tls, uprobe_multi
from exporter.commands.daemon import Nettap
from exporter.kernel.bpfstats import own_program_stats

import gobuild

CASES = ("no uprobe", "empty uprobes", "not captured", "captured, TLS off", "captured")
KINDS = ("go", "openssl")
TITLE = {"go": "Go crypto/tls.(*Conn).Write", "openssl": "OpenSSL SSL_write_ex (Python's ssl)"}
# case -> (the client is the target, capture.tls, empty uprobes attached)
SETUP = {"no uprobe": (False, False, False), "empty uprobes": (False, False, True),
         "not captured": (False, True, False), "captured, TLS off": (True, False, False),
         "captured": (True, True, False)}
MECH = {"uprobe_multi": "uprobe_multi links", "uprobe": "perf-event uprobes"}
EMPTY = {"go": ("empty_go_enter", "empty_go_ret"), "openssl": ("empty_ssl_enter", "empty_ssl_exit")}

PY_CLIENT = r"""
import socket, ssl, statistics, sys, time
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
port, size, n = (int(a) for a in sys.argv[1:4])
print("ready", flush=True)      # libssl mapped: the target's files are there to find
sys.stdin.readline()
s = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port)))
m, took, clock = b"x" * size, [0] * n, time.perf_counter_ns
for i in range(n):
    t = clock()
    s.sendall(m)
    took[i] = clock() - t
print("ns", int(statistics.median(took)), sum(took) // n, flush=True)
s.close()
"""
LIBSSL = "import ssl; print([l.split()[-1] for l in open('/proc/self/maps') if '/libssl.so' in l][0])"


def available() -> tuple:
    """(True, "") where this section can run, else (False, why)."""
    if not tls.supported()[0]:
        return False, "no uprobes on this kernel"
    ok, why = gobuild.available()
    return ok, why


def mechanism() -> str:
    """How nettap attaches TLS uprobes here (tls.mechanism): the empties' too."""
    multi = uprobe_multi.supported()[0] and os.environ.get(tls.FORCE_ENV) != "uprobe"
    return "uprobe_multi" if multi else "uprobe"


class Workload:
    """The cert, the Go binary's three copies (client, decoy target, server),
    the server and the decoy running, and the libssl file Python maps."""

    def __init__(self):
        self.tmp = tempfile.mkdtemp(prefix="nettap-bench-tls-")
        self.cert = (os.path.join(self.tmp, "c.pem"), os.path.join(self.tmp, "k.pem"))
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", self.cert[1], "-out", self.cert[0], "-days", "1",
                        "-subj", "/CN=localhost"], check=True, capture_output=True)
        built = gobuild.build("gotls", "plain")
        self.bins = {}
        for role in ("client", "decoy", "server"):
            self.bins[role] = os.path.join(self.tmp, f"gotls-{role}")
            shutil.copy2(built, self.bins[role])
        self.go = goelf.inspect(self.bins["client"])
        self.libssl = os.path.realpath(subprocess.run([sys.executable, "-c", LIBSSL], check=True,
                                                      capture_output=True, text=True).stdout.strip())
        self.procs = []
        try:
            self.port = self._serve("server")
            self._serve("decoy")
        except BaseException:
            self.close()
            raise
        self.decoy = self.procs[-1].pid

    def _serve(self, role: str) -> int:
        p = subprocess.Popen([self.bins[role], "sink-server", "-cert", self.cert[0], "-key", self.cert[1]],
                             stdout=subprocess.PIPE, text=True)
        self.procs.append(p)
        line = p.stdout.readline().split()
        if line[:1] != ["listening"]:
            raise RuntimeError(f"the Go {role} did not start: {line}")
        return int(line[1])

    def client(self, kind: str, n: int) -> subprocess.Popen:
        """A client, waiting for a line on stdin before it connects, once it
        said "ready" (the Go one runs its file; the Python one has mapped libssl)."""
        args = ([self.bins["client"], "write-loop", "-addr", f"127.0.0.1:{self.port}", "-n", str(n),
                 "-size", "64", "-wait"] if kind == "go"
                else [sys.executable, "-c", PY_CLIENT, str(self.port), "64", str(n)])
        p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if p.stdout.readline().strip() != "ready":
            p.kill()
            p.wait()
            raise RuntimeError(f"the {kind} TLS client did not start")
        return p

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
            p.stdout.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class Empties:
    """The empty uprobe programs (bench/empty.bpf.c), loaded once for the
    mechanism nettap uses; attach(kind) puts them where nettap's programs
    for that client go, detach() takes them off."""

    def __init__(self, empty_obj: str, mech: str, work: Workload):
        self.mech, self.work, self.links = mech, work, []
        self.obj = libbpf.call_ptr("bpf_object__open_file", empty_obj.encode(), None)
        want = {n for pair in EMPTY.values() for n in pair}
        for name, prog in loader.object_programs(self.obj):
            libbpf.call("bpf_program__set_autoload", prog, name in want)
            if name in want and mech == "uprobe_multi":
                libbpf.call("bpf_program__set_expected_attach_type", prog, uprobe_multi.BPF_TRACE_UPROBE_MULTI)
        libbpf.call("bpf_object__load", self.obj)
        self.progs = {n: libbpf.call_ptr("bpf_object__find_program_by_name", self.obj, n.encode()) for n in want}
        self.fds = {kind: {"empty entry": libbpf.call("bpf_program__fd", self.progs[e]),
                           "empty return": libbpf.call("bpf_program__fd", self.progs[r])}
                    for kind, (e, r) in EMPTY.items()}

    def attach(self, kind: str) -> None:
        enter, ret = (self.progs[n] for n in EMPTY[kind])
        if kind == "go":
            path, go = self.work.bins["client"], self.work.go
            sites = [(enter, [go.write_entry], False), (ret, list(go.write_rets), False)]
        else:
            path = self.work.libssl
            off = uprobe_multi.symbol_offsets(path, ["SSL_write_ex"])["SSL_write_ex"]
            sites = [(enter, [off], False), (ret, [off], True)]
        for prog, offsets, is_ret in sites:
            if self.mech == "uprobe_multi":
                self.links.append(uprobe_multi.link(uprobe_multi.prog_fd(prog), path, offsets, is_ret))
            else:
                self.links += [tls.attach_uprobe(prog, path, None, is_ret, o) for o in offsets]

    def detach(self) -> None:
        loader.destroy_links(self.links)
        self.links = []

    def close(self) -> None:
        self.detach()
        libbpf.lib().bpf_object__close(self.obj)


def nettap_fds(app, kind: str, variant: str) -> dict:
    """label -> fd of nettap's programs that run for the client's writes."""
    suffix = "" if variant == "fast" else "_compat"
    if kind == "go":
        return {"nettap entry": app.probes.prog_fds[gotls.ENTRY["go_tls_write"]],
                "nettap return": app.probes.prog_fds[gotls.RET["go_tls_write"] + suffix]}
    return {"nettap entry": app.probes.prog_fds["ssl_write_ex_enter"],
            "nettap return": app.probes.prog_fds[tls.RETURNS["ssl_write"] + suffix]}


def uprobe_fds(app, empties: Empties) -> dict:
    """Every uprobe program of nettap's (libssl's and Go's) and the empties."""
    names = [n for n in dict.fromkeys(tls.programs("fast") + tls.programs("compat") + gotls.programs("fast")
                                      + gotls.programs("compat"))
             if n in app.probes.prog_fds and n not in (tls.MMAP, gotls.EXEC)]
    fds = {n: app.probes.prog_fds[n] for n in names}
    fds.update({f"{kind} {label}": fd for kind, d in empties.fds.items() for label, fd in d.items()})
    return fds


def _check_files(app, kind: str, case: str, work: Workload) -> None:
    """The files nettap has uprobes on are those the case means."""
    files = set(app.probes.tls.files.values()) if app.probes.tls else set()
    want = set()
    if SETUP[case][1]:
        want = ({os.path.realpath(work.bins["client"])} if kind == "go" else {work.libssl}) \
            if SETUP[case][0] else {os.path.realpath(work.bins["decoy"])}
    if {os.path.realpath(f) for f in files} != want:
        raise RuntimeError(f"{kind}, {case}: nettap's TLS uprobes are on {sorted(files)}, not {sorted(want)}")


def run_case(app, empties: Empties, work: Workload, kind: str, case: str, n: int, fds: dict) -> tuple:
    """One client run: ((median, mean) ns per call, {label: (runs, ns)} of fds)."""
    target, tls_on, empty = SETUP[case]
    client = work.client(kind, n)
    try:
        app.apply(config.parse({"captures": [{"pid": client.pid if target else work.decoy}],
                                "capture": {"tls": tls_on, "tls_attach": "targets"}, "output": {"type": "none"}}))
        _check_files(app, kind, case, work)
        if empty:
            empties.attach(kind)
        before = own_program_stats(fds)
        out, _ = client.communicate("go\n", timeout=300)
        after = own_program_stats(fds)
    finally:
        empties.detach()
        if client.poll() is None:
            client.kill()
            client.wait()
    words = out.split()
    if client.returncode or words[:1] != ["ns"]:
        raise RuntimeError(f"{kind} client, {case}: exit {client.returncode}, {out!r}")
    return (int(words[1]), int(words[2])), {k: (after[k][0] - before[k][0], after[k][1] - before[k][1])
                                            for k in fds}


def measure_tls(variant: str, empty_obj: str, n: int, rounds: int = 15) -> dict:
    """{"mech", "calls": {kind: {case: [(median, mean) per round]}},
    "programs": {kind: {case: {label: [runs, ns]}}}, "uprobe runs": {kind:
    {case: runs of every uprobe program}}} for one variant."""
    mech = mechanism()
    work = Workload()
    empties = app = None
    try:
        empties = Empties(empty_obj, mech, work)
        app = Nettap(config.parse({"captures": [{"pid": work.decoy}], "output": {"type": "none"}}), variant=variant)
        if app.probes.tls_mech != mech:
            raise RuntimeError(f"nettap attaches TLS uprobes by {app.probes.tls_mech}, the empties by {mech}")
        every = uprobe_fds(app, empties)
        out = {"mech": mech, "calls": {k: {c: [] for c in CASES} for k in KINDS},
               "programs": {k: {c: {} for c in CASES} for k in KINDS},
               "uprobe runs": {k: dict.fromkeys(CASES, 0) for k in KINDS}}
        for r in range(rounds):
            for kind in KINDS:
                fds = {**every, **empties.fds[kind], **nettap_fds(app, kind, variant)}
                for case in CASES[r % len(CASES):] + CASES[:r % len(CASES)]:
                    call, d = run_case(app, empties, work, kind, case, n, fds)
                    out["calls"][kind][case].append(call)
                    out["uprobe runs"][kind][case] += sum(d[k][0] for k in every)
                    progs = out["programs"][kind][case]
                    for label in (*empties.fds[kind], *nettap_fds(app, kind, variant)):
                        progs.setdefault(label, [0, 0])
                        progs[label][0] += d[label][0]
                        progs[label][1] += d[label][1]
        return out
    finally:
        if app:
            app.close()
        if empties:
            empties.close()
        work.close()


def _med(calls: list, i: int = 0) -> float:
    return statistics.median(c[i] for c in calls)


def print_kind(kind: str, res: dict) -> None:
    """One client's table. The derived figures take each case's least
    per-run median over the rounds: on a shared machine interference only
    adds, so the quietest round is the closest to the cost."""
    calls, progs, runs = res["calls"][kind], res["programs"][kind], res["uprobe runs"][kind]
    print(f"\n{TITLE[kind]:36s} {'min':>7s} {'median':>7s} {'max':>7s} {'mean':>7s} {'uprobe runs':>12s}")
    for case in CASES:
        meds = [c[0] for c in calls[case]]
        print(f"{case:36s} {min(meds):7d} {_med(calls[case]):7.0f} {max(meds):7d} {_med(calls[case], 1):7.0f}"
              f" {runs[case]:12d}")
    print(f"{'program (BPF stats, ns per run)':36s} {'runs':>9s} {'ns':>6s}")
    per_call = {}
    for case, side in (("empty uprobes", "empty"), ("captured", "nettap")):
        per_call[side] = 0.0
        for role in ("entry", "return"):
            r, t = progs[case][f"{side} {role}"]
            per_call[side] += t / r if r else float("nan")
            print(f"{side + ' ' + role + ' (' + case + ')':36s} {r:9d} {t / r if r else float('nan'):6.0f}")
    m = {c: min(x[0] for x in calls[c]) for c in CASES}
    trap = m["empty uprobes"] - m["no uprobe"]
    tcp = m["captured, TLS off"] - m["no uprobe"]
    add = m["captured"] - m["empty uprobes"] - tcp
    print(f"from the min column: bare trap (empty - no uprobe) {trap:.0f} ns; capturing the TCP connection "
          f"(captured, TLS off - no uprobe) {tcp:+.0f} ns; nettap's TLS programs add (captured - empty - that) "
          f"{add:+.0f} ns = {100 * add / trap:.0f} % of the bare trap (goal <= 50 %: "
          f"{'met' if add <= trap / 2 else 'NOT met'}; their run time over the empty ones', BPF stats: "
          f"{per_call['nettap'] - per_call['empty']:+.0f} ns a call); not captured - no uprobe "
          f"{m['not captured'] - m['no uprobe']:+.0f} ns, {runs['not captured']} uprobe runs "
          f"(no trap: {'met' if runs['not captured'] == 0 else 'NOT met'})")


def print_tls(n: int, rounds: int, results: list) -> None:
    for variant, res in results:
        print(f"\nTLS calls, {variant} variant ({MECH[res['mech']]}; ns per call as the client's clock sees it: "
              f"{rounds} rounds: min, median and max of the per-run medians, median of the means; "
              f"a client sending {n:,} messages of 64 B, one write call each, to a Go server; the cases "
              f"interleaved, their order turned each round)")
        for kind in KINDS:
            print_kind(kind, res)
    print("\n(uprobe runs: runs of every uprobe program, nettap's and the empty ones, during the case's runs; "
          "0 = no trap. empty: programs that return at once, at the entry and at each RET of Write (Go), "
          "at the entry and return of SSL_write_ex (OpenSSL); goal: nettap's TLS programs add <= 50 % of "
          "the bare trap, and a process not captured pays no trap)")
