"""Kernel tests of the loader: every program the kernel can run passes its
verifier, and what the loader's probing says agrees with what the kernel
does with nettap's own programs. Nothing here names a kernel's refusals:
the kernel is asked."""
import pytest

from conftest import kernel_modes
from exporter.kernel import arch, dns, features, gotls, libbpf, loader, mechanisms, tls



def _load_only(names, variant) -> None:
    """Load the object with autoload on only for names, configured for this
    kernel as the loader does (raises OSError)."""
    lb = libbpf.lib()
    feats = mechanisms.plan("tracepoint").features
    obj = libbpf.call_ptr("bpf_object__open_file", arch.object_path(loader.object_for(feats)).encode(), None)
    try:
        loader.configure(obj, feats, variant, set(names), {})
        libbpf.call("bpf_object__load", obj)
    finally:
        lb.bpf_object__close(obj)


def _variants():
    modes = kernel_modes()
    assert modes, "kernel tests need root and a kernel nettap can load on"
    return sorted({v for _, v in modes})


@pytest.mark.parametrize("mechanism", ["kprobe", "tracepoint"])
def test_every_variant_the_kernel_runs_passes_the_verifier(mechanism):
    # Loading kprobe and tracepoint programs needs no kprobe support (only
    # attaching does), so the verifier sees them on every kernel: the TCP
    # probes' and the DNS probe's
    for variant in _variants():
        progs = [n for probe in loader.PROBES for n in loader.programs_for(probe, mechanism, variant)]
        _load_only(progs + dns.programs(variant, mechanism), variant)


def test_every_tls_program_passes_the_verifier():
    # the uprobes on libssl and the dlopen ring's mmap tracepoint, in each variant
    if not tls.supported()[0]:
        pytest.skip(tls.supported()[1])
    for variant in _variants():
        _load_only(tls.programs(variant), variant)


def test_every_lifecycle_program_passes_the_verifier():
    # tcp_state, tcp_destroy, the resets', and those reported as probes of their
    # own where the kernel has what they need (Linux 6.1's verifier once refused
    # a counter's index the newer ones accept)
    feats = mechanisms.plan("tracepoint").features
    for variant in _variants():
        progs = list(loader.lifecycle_programs(variant))
        progs += [prog for progs_, _ in loader.separate_programs(feats, variant).values() for prog in progs_]
        _load_only(progs, variant)


def _refusing(monkeypatch, prefix):
    """The loader's configure, then the programs named prefix* made socket
    filters: the kernel refuses what they call (tracing helpers, context)."""
    real = loader.configure

    def configure(obj, feats, variant, want, ring_sizes):
        real(obj, feats, variant, want, ring_sizes)
        for name, prog in loader.object_programs(obj):
            if name.startswith(prefix) and name in want:
                libbpf.call("bpf_program__set_type", prog, 1)    # BPF_PROG_TYPE_SOCKET_FILTER
    monkeypatch.setattr(loader, "configure", configure)


def test_a_separate_program_the_kernel_refuses_is_reported_and_the_rest_loads(monkeypatch):
    """A kernel whose verifier refuses one of the separately reported
    programs (the accept hook here) still runs nettap: that probe reported
    unattached with the kernel's error, every other probe attached."""
    _refusing(monkeypatch, "tcp_accept")
    with loader.Probes() as p:
        states = p.all_states()
        acc = states["tcp_accept"]
        assert (acc.mechanism, acc.attached, acc.reported) == ("none", False, "none")
        assert acc.error.startswith("the kernel refused its program: ")
        assert not any(n.startswith("tcp_accept") for n in p.prog_fds)
        assert states["tcp_state"].attached
        others = {n: s for n, s in states.items()
                  if n != "tcp_accept" and s.mechanism not in ("none", "unsupported", "disabled")}
        assert others and all(s.attached for s in others.values()), others


def test_tls_programs_load_at_first_use_and_a_refusal_loses_tls_only(monkeypatch):
    """A start without capture.tls loads no TLS program; the first set_tls(True)
    loads them in an object of their own. A kernel refusing them leaves every
    TLS probe unattached with its error, the rest running, and the next
    set_tls(True) tries again."""
    if not tls.supported()[0]:
        pytest.skip(tls.supported()[1])
    with loader.Probes(tls_now=False) as p:
        progs = set(tls.programs(p.variant) + gotls.programs(p.variant))
        assert p.tls_deferred and not progs & set(p.prog_fds)
        with monkeypatch.context() as m:
            _refusing(m, "go_tls_read_ret")
            p.set_tls(True, processes=lambda: [])
        assert {(st.mechanism, st.attached) for st in p.tls_states.values()} == {("none", False)}
        assert all(st.error.startswith("the kernel refused the TLS programs: ") for st in p.tls_states.values())
        assert p.tls is None and p.tls_deferred and not p.tls_obj and not progs & set(p.prog_fds)
        assert all(st.attached for st in p.states.values() if st.mechanism != "none")
        p.set_tls(True, processes=lambda: [])
        assert p.tls is not None and p.tls_obj and not p.tls_deferred and progs <= set(p.prog_fds)
        p.set_tls(False)


def test_a_refused_lifecycle_program_is_a_failure_to_start(monkeypatch):
    _refusing(monkeypatch, "tcp_state")
    with pytest.raises(OSError):
        loader.Probes()


def test_fentry_programs_load_exactly_where_the_loader_says_fentry_works():
    accepted = "fentry" in {m for m, _ in kernel_modes()}
    assert (mechanisms.plan("fentry").dns.mechanism == "fentry") == accepted      # the DNS probe's own check agrees
    for variant in _variants():
        progs = [n for probe in loader.PROBES for n in loader.programs_for(probe, "fentry", variant)]
        progs += dns.programs(variant, "fentry")
        if accepted:
            _load_only(progs, variant)
        elif mechanisms.preempt_rt():         # declined on PREEMPT_RT, whether it would load or not
            reason = mechanisms.plan("fentry").states["tcp_sendmsg"].reasons["fentry"]
            assert reason.startswith("PREEMPT_RT kernel")
        else:
            with pytest.raises(OSError):
                _load_only(progs, variant)


def test_the_fast_variant_is_offered_exactly_when_every_feature_is_present():
    kp = mechanisms.plan("tracepoint")
    have = all(f.present for f in kp.features)
    assert kp.variant == ("fast" if have else "compat")
    if not have:
        with pytest.raises(features.Unsupported, match="cannot run the fast programs"):
            mechanisms.plan("tracepoint", "fast")


@pytest.mark.parametrize("mechanism", mechanisms.MECHANISMS)
def test_forcing_a_mechanism_attaches_it_or_reports_the_probe_unattached(mechanism):
    accepted = mechanism in {m for m, _ in kernel_modes()}
    with loader.Probes(mechanism=mechanism) as p:
        for st in p.states.values():
            others = [m for m in mechanisms.MECHANISMS if m != mechanism]
            # mechanisms after the chosen one are not tried at all
            assert all(st.reasons.get(m, "not requested") == "not requested" for m in others)
            if accepted:
                assert (st.mechanism, st.attached, st.error) == (mechanism, True, "")
            else:
                assert (st.mechanism, st.attached) == ("none", False)
                assert st.error.startswith("no mechanism accepted") and st.reasons[mechanism]
        assert p.lifecycle.attached                  # the lifecycle programs run either way
        separate = loader.separate_programs(p.plan.features, p.variant)    # where the kernel has what they need
        assert {n for n, st in p.separate.items() if st.attached} == set(separate)
        tps = loader.attached_tracepoints()
        separate_links = sum(len(tps[n]) if m == "tracepoint" else 1 for progs, m in separate.values() for n in progs)
        calls = (sum(len(tps[n]) for probe in loader.PROBES for n in loader.programs_for(probe, "tracepoint"))
                 if mechanism == "tracepoint" and accepted else 4 if accepted else 0)
        assert sum(len(links) for links in p.sep.links.values()) == separate_links      # (set_records' to detach)
        assert len(p.links) == len(loader.lifecycle_programs()) + calls
