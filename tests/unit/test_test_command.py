"""The test command itself: the guests run every test under tests/kernel
(scripts/kernel_matrix.py's selection against the directory's collection),
and scripts/stages.py's table adds up what test.sh and the matrix recorded."""
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _collect(*args):
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    return {l for l in p.stdout.splitlines() if "::" in l}


def test_the_guests_select_every_test_under_tests_kernel():
    selection = _script("kernel_matrix").GUEST_SELECTION
    everything = _collect("tests/kernel")
    assert everything and all(t.startswith("tests/kernel/") for t in everything)
    assert _collect(*selection) == everything


def test_a_kernels_shards_select_each_of_its_tests_once():
    km = _script("kernel_matrix")
    everything = _collect(*km.GUEST_SELECTION)
    kernels = {n for n, _, _ in km.KERNELS}

    def selected(name):
        """What the guests of kernel name run: its shards' selections, or every test."""
        shards = km.SHARDS.get(name)
        return set().union(*(_collect(*km.GUEST_SELECTION, *km.with_k([], k)) for _g, k in shards)) \
            if shards else everything

    for name, shards in km.SHARDS.items():
        picked = [_collect(*km.GUEST_SELECTION, *km.with_k([], k)) for _g, k in shards]
        lefts = []
        for other, k in km.LEFT_TO.get(name, []):     # run by another kernel's guests: none a capture test
            left = _collect(*km.GUEST_SELECTION, *km.with_k([], k))
            assert left and not any("[" in t and ("-compat" in t or "-fast" in t) for t in left), (name, k)
            assert other in kernels and other != name and left <= selected(other), (name, other)
            lefts.append(left)
        assert all(picked)
        assert sum(len(p) for p in picked) + sum(len(l) for l in lefts) == len(everything), name
        assert set().union(*lefts, *picked) == everything, name
    assert set(km.LEFT_TO) <= set(km.SHARDS)


def test_the_arm64_guests_run_every_named_test_and_a_test_of_each_probe_family():
    km = _script("kernel_matrix")
    everything = _collect(*km.GUEST_SELECTION)
    assert set(km.SUBSETS) == set(km.ARCHES) and not set(km.SHARDS) & set(km.ARCHES)
    for name, k in km.SUBSETS.items():
        picked = _collect(*km.GUEST_SELECTION, *km.with_k([], k))
        # each name is a test (a renamed test fails here, not by running nothing in the guest)
        for test in km.ARM64_TESTS:
            assert any(t.split("::")[1].split("[")[0] == test for t in picked), (name, test)
        assert picked < everything
        families = {t.split("::")[0].rsplit("/", 1)[1] for t in picked}
        assert {"test_capture.py", "test_tls.py", "test_gotls.py", "test_dns.py", "test_retransmit.py",
                "test_segments.py", "test_loader.py", "test_record_kinds.py", "test_node_names.py"} <= families
        # a capture test once per mechanism the kernel accepts, as on x86-64
        storm = "test_connection_storm_one_eof_per_socket_none_dropped"
        assert len([t for t in picked if storm in t]) == len([t for t in everything if storm in t])


def test_guests_are_split_into_lanes_whose_longest_is_shortest():
    km = _script("kernel_matrix")
    jobs = km.guest_jobs([(n, f"r{n}") for n, _, _ in km.KERNELS])
    assert {g for g, _r, _k in jobs} == set(km.EXPECTED)
    lanes = km.lanes(jobs, 2)
    assert sorted(j for lane in lanes for j in lane) == sorted(jobs)
    # the guests that mostly wait (PREEMPT_RT's) beside the two lanes, alone in theirs
    assert len(lanes) == 2 + km.WAITING_LANES
    assert {g for lane in lanes[2:] for g, _r, _k in lane} == set(km.WAITING)
    busy = {g: t for g, t in km.EXPECTED.items() if g not in km.WAITING}
    longest = max(sum(busy[g] for g, _r, _k in lane) for lane in lanes[:2])
    assert longest <= sum(busy.values()) / 2 + min(busy.values())
    assert [j for lane in km.lanes(jobs, 1) for j in lane] == sorted(jobs, key=lambda j: -km.EXPECTED[j[0]])
    # a -k of the caller's own is and-ed with the shard's, not replaced (pytest keeps only the last -k)
    assert km.with_k(["-k", "test_dns", "-x"], "tracepoint-") == ["-k", "(test_dns) and (tracepoint-)", "-x"]


def test_stage_table_splits_the_host_run_by_tier_and_each_guest_into_boot_and_tests(tmp_path):
    (tmp_path / "stages.tsv").write_text(
        "start\t1000.0\nset-up\t1010.0\nchecks\t1012.5\nhost\t1100.0\nmatrix\t1500.0\n")
    (tmp_path / "host.xml").write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.unit.test_a" name="t1" time="20.0"/>'
        '<testcase classname="tests.kernel.test_b" name="t2[tracepoint-fast]" time="30.0"/>'
        '<testcase classname="tests.e2e.test_c" name="t3" time="33.0"/>'
        '</testsuite></testsuites>')
    (tmp_path / "guests.tsv").write_text("6.1\t9.5\t200.0\n5.10\t\t150.0\n")
    table, total = _script("stages").rows(str(tmp_path))
    assert [(n, round(s, 1)) for n, s in table] == [
        ("set-up (Debian packages, virtualenv)", 10.0),
        ("BPF objects and rendered mixin fresh", 2.5),
        ("host: unit tests", 20.0), ("host: kernel tests", 30.0), ("host: e2e tests", 33.0),
        ("host: pytest start, collection, the rest", 4.5),
        ("guest 6.1: boot", 9.5), ("guest 6.1: tests", 190.5),
        ("guest 5.10: did not report its boot", 150.0),
        ("kernel matrix: fetch, install, report", 50.0),
    ]
    assert total == 500.0
    # the unit tests on their own, two at a time (test.sh's CI run): their stage's wall clock
    (tmp_path / "stages.tsv").write_text(
        "start\t1000.0\nset-up\t1010.0\nchecks\t1012.5\nhost-unit\t1030.0\nhost\t1100.0\nmatrix\t1500.0\n")
    (tmp_path / "host.xml").write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.kernel.test_b" name="t2[tracepoint-fast]" time="30.0"/>'
        '<testcase classname="tests.e2e.test_c" name="t3" time="33.0"/>'
        '</testsuite></testsuites>')
    table, total = _script("stages").rows(str(tmp_path))
    assert [(n, round(s, 1)) for n, s in table][2:6] == [
        ("host: unit tests, two at a time", 17.5), ("host: kernel tests", 30.0), ("host: e2e tests", 33.0),
        ("host: pytest start, collection, the rest", 7.0)]
    assert total == 500.0
    # CI's run: the e2e tests beside the guests (host-e2e.xml, mark e2e): a row of their own, not the host's
    (tmp_path / "stages.tsv").write_text("start\t1000.0\nset-up\t1010.0\nchecks\t1012.5\nhost-unit\t1030.0\n"
                                         "host\t1065.0\nmatrix\t1500.0\ne2e\t1502.0\n")
    (tmp_path / "host.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.kernel.test_b" name="t2" time="30.0"/>'
        '</testsuite></testsuites>')
    (tmp_path / "host-e2e.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.e2e.test_c" name="t3" time="33.0"/>'
        '</testsuite></testsuites>')
    table, total = _script("stages").rows(str(tmp_path))
    rows = [(n, round(s, 1)) for n, s in table]
    assert rows[3:5] == [("host: kernel tests", 30.0), ("host: pytest start, collection, the rest", 5.0)]
    assert rows[-2:] == [("host: e2e tests, beside the guests", 33.0),
                         ("host: e2e tests, waited for after the guests", 2.0)]
    assert total == 502.0
    # the unit tests beside the guests too (test.sh writes their wall clock): a row before the others
    (tmp_path / "host-unit.took").write_text("95.25\n")
    rows = [(n, round(s, 1)) for n, s in _script("stages").rows(str(tmp_path))[0]]
    assert rows[-3] == ("host: unit tests, two at a time, beside the guests", 95.2)
    (tmp_path / "host-unit.took").unlink()
    (tmp_path / "host-e2e.xml").unlink()
    (tmp_path / "stages.tsv").write_text(
        "start\t1000.0\nset-up\t1010.0\nchecks\t1012.5\nhost-unit\t1030.0\nhost\t1100.0\nmatrix\t1500.0\n")
    # two at a time (the fourth column: when each booted): the matrix's own work is what no guest covers
    (tmp_path / "guests.tsv").write_text("6.1\t9.5\t200.0\t1100.0\n6.1-rt\t8.0\t300.0\t1100.5\n"
                                         "5.10\t7.0\t100.0\t1300.0\n")
    table, _ = _script("stages").rows(str(tmp_path))
    assert [(n, round(s, 1)) for n, s in table][-3:] == [
        ("guest 5.10: tests", 93.0), ("guests, wall clock (they overlap)", 300.5),
        ("kernel matrix: fetch, install, report", 99.5)]
