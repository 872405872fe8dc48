#!/usr/bin/python3
"""Kernel matrix: boot Debian's stock kernels in qemu guests and run the kernel tests there.

    scripts/kernel_matrix.py [--out DIR] [--host-junit FILE] [--table FILE] [--timeout S]
                             [--budget S] [--jobs N] [--cache DIR] [-- PYTEST_ARGS]

For each kernel below: fetch the newest Debian package with `apt-get download` (cached in
--cache), put its modules and vmlinuz under /lib/modules/<release> (depmod'ed, removed again at
exit), boot it with virtme-ng over the host's root filesystem (TCG: nested KVM hangs here) and
run `pytest -m kernel tests/kernel` inside. The guest writes its results to --out, shared
read-write; everything else it sees is the host's root, read-only or behind a throwaway overlay
(/tmp, /etc, /usr, /var are writable in the guest, not the checkout unless it lives in /tmp).

Prints (and writes to --table) a markdown table kernel x mechanism x passed/failed/skipped, with
the host's kernel tests as a row when --host-junit is given. Exits non-zero when a kernel cannot
be fetched or booted, its guest left no results, or any of its tests failed. Run as root.
"""
import argparse
import os
import lzma
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import xml.etree.ElementTree as ET
import itertools
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import arm64_guest  # noqa: E402
import guest_image  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (name, package name regex, suite); the newest match is used. Suite None: from this host's
# apt sources (`apt-cache search --names-only`); else read straight from that suite's package
# index on the security mirror apt already uses (Debian 11's 5.10, the LTS of Amazon Linux 2 and
# older fleets, without adding bullseye to a bookworm host's sources).
KERNELS = [
    ("5.10", r"^linux-image-5\.10\.0-[0-9]+-amd64-unsigned$", "bullseye-security"),
    ("6.1", r"^linux-image-6\.1\.0-[0-9]+-amd64-unsigned$", None),
    ("6.1-rt", r"^linux-image-6\.1\.0-[0-9]+-rt-amd64-unsigned$", None),
    ("6.12", r"^linux-image-6\.12\.[0-9]+\+deb12-amd64-unsigned$", None),  # bookworm-security or -backports
    # arm64 (Graviton, Ampere): the same releases under qemu-system-aarch64, over an arm64 root
    # file system (scripts/arm64_guest.py), running ARM64_TESTS
    ("6.1-arm64", r"^linux-image-6\.1\.0-[0-9]+-arm64-unsigned$", "bookworm-security"),
    ("6.12-arm64", r"^linux-image-6\.12\.[0-9]+\+deb12-arm64-unsigned$", "bookworm-security"),
]
# Debian's architecture of each kernel that is not the host's (amd64)
ARCHES = {"6.1-arm64": "arm64", "6.12-arm64": "arm64"}
# What each guest runs: every test under tests/kernel (tests/kernel/conftest.py marks them all
# kernel; tests/unit/test_test_command.py holds this equal to that directory's collection).
GUEST_SELECTION = ["-m", "kernel", "tests/kernel"]
SLOWEST = 15                           # the slowest tests printed per guest (where the time goes)
MECHANISMS = ("fentry", "kprobe", "tracepoint")
VARIANTS = ("fast", "compat")           # BPF program variants (exporter/kernel/features.py)
GUEST_OUT = "/tmp/nettap-matrix-out"   # where --out is mounted in the guest (guest /tmp is writable)
# Guests at once. A guest keeps ~1.2 of this host's 2 CPUs busy (qemu's TCG threads), so two
# at a time use the machine: the four took 28 min two at a time where one at a time took 42
# (each beside the same other work). Three at once (each ~1.8x slower than alone) starved
# the guests' timing-bound tests (the storm, the targets' waits). (WAITING: a lane of mostly idle guests.)
JOBS = 2
# One TCG thread a guest, its two vCPUs taken in turn (the guest still has two CPUs: per-CPU
# maps, kretprobes' maxactive and preemption as on a 2-CPU node): two guests of multi-threaded
# TCG put four busy threads on this host's two CPUs, and 6.1 and 6.12 side by side took 719 and
# 695 s; one thread each, 443 and 420 s (2026-12-06, the same tests; one vCPU each was as fast,
# but a kretprobe's maxactive of 1 lost returns a 2-CPU node does not).
QEMU_OPTS = "-accel tcg,thread=single"
# The x86 guests' CPU: vng's TCG default, `-cpu max`, gives the guest AVX, MPX and PKRU state,
# which the kernel saves and restores by XSAVE at every context switch (2,696 bytes a task,
# emulated; its boot log says so), and AVX2 for user space's libraries to pick; a 64-bit CPU with SSE4.2,
# POPCNT and AES-NI (what every x86 node has, what OpenSSL and Go pick their AES by) saves
# its FPU state by FXSAVE (512 bytes). The same capture tests in the 6.12 guest: 89 and 92 s
# against 98 and 98 (2026-12-07, one guest alone).
X86_CPU = "qemu64,+ssse3,+sse4.1,+sse4.2,+popcnt,+aes,+pclmulqdq"
# A kernel's tests may run in several guests (shards: name -> (guest name, pytest -k), which
# together select every test once; tests/unit/test_test_command.py checks that): PREEMPT_RT runs
# every test ~1.7x slower than 6.1 does, and whole it took 920 s where the next longest took 600,
# so two guests at a time could not end together. Five guests in two lanes put three in one:
# at c271070 those three took 1,843 s beside the other's 1,456; 6.1 in two shards evens them.
# PREEMPT_RT is 6.1 with sleeping locks and threaded interrupts: the same release, the same BPF
# features. Its guests run every capture test once per mechanism and every test of what the
# kernel does (the loader, preallocated maps, in-flight state, targets, timers), and leave the
# privileges' tests to 6.1's guest, the same release.
# The tests of what nettap's process does alone, with no mode (its TLS files' handling, two
# instances, sinks, `read`, concurrent scrapes, the run script, the node view's names: ~130-220 s
# of a guest in CI) run on the host (6.18: the fast variant, uprobe_multi) and in the oldest
# guest, 5.10 (compat, uprobes by perf events), the two ends of what a kernel offers them; 6.1's,
# 6.1-rt's and 6.12's guests leave them there. The privileges' tests stay in every x86 guest but
# RT's: the kernel checks the capabilities.
# LEFT_TO: kernel -> [(the kernel whose guests run them, their -k)]; the unit test checks that
# those guests select them, and that the shards and these cover every test once.
MODES = "fentry- or kprobe- or tracepoint-"
PROCESS_ONLY = ("test_tls_files or test_instances or test_sink_lifecycle or test_read or "
                "test_scrape_concurrency or test_run_script or test_node_names")
LEFT = f"not ({MODES}) and ({PROCESS_ONLY})"
PRIVILEGES = f"not ({MODES}) and test_privileges"
LEFT_TO = {"6.1-rt": [("5.10", LEFT), ("6.1", PRIVILEGES)], "6.1": [("5.10", LEFT)], "6.12": [("5.10", LEFT)]}
SHARDS = {"6.1-rt": [("6.1-rt", f"not tracepoint- and not ({LEFT}) and not ({PRIVILEGES})"),
                     ("6.1-rt.tp", "tracepoint- and not (test_tls or test_gotls)"),
                     ("6.1-rt.tls", "tracepoint- and (test_tls or test_gotls)")],
          "6.1": [("6.1", f"not tracepoint- and not ({LEFT})"), ("6.1.tp", "tracepoint-")],
          "6.12": [("6.12", f"not ({LEFT})")]}
# The arm64 guests run a fixed subset (a third arm64 lane of every test would not fit CI's 30
# minutes on two CPUs): every probe family's exact counts once per mechanism the kernel accepts
# (sends and receives byte-exact, a port target's counts, uncaptured traffic adding zero, the
# lifecycle's state lines, segments, the retransmit timer, a loss recovered, DNS, OpenSSL's and
# Go's TLS), the storm (none lost), the verifier on every variant and family, the default records
# of a request, and the node walk. tests/unit/test_test_command.py holds each name to a test.
ARM64_TESTS = ("test_every_send_and_receive_call_byte_exact", "test_port_target_counts_exactly_and_captures_bytes",
               "test_uncaptured_traffic_adds_exactly_zero",
               "test_state_lines_follow_each_captured_connection_from_its_first_state",
               "test_connection_storm_one_eof_per_socket_none_dropped",
               "test_every_variant_the_kernel_runs_passes_the_verifier",
               "test_every_lifecycle_program_passes_the_verifier", "test_every_tls_program_passes_the_verifier",
               "test_tls_echo_by_port", "test_go_tls_echo_of_a_pid_target",
               "test_queries_and_answers_are_recorded_and_matched",
               "test_a_segment_lost_among_others_is_recovered_on_acks",
               "test_the_retransmit_timer_fires_for_the_probe_then_the_rto",
               "test_segments_are_recorded_for_the_targets_that_ask",
               "test_the_default_records_of_a_request_on_a_new_connection", "test_compiled_walk_sees_what_libbpf_sees")
SUBSETS = {name: " or ".join(ARM64_TESTS) for name in ARCHES}
# Seconds each guest took in CI (boot included): the guests are split into --jobs lanes, each
# run one guest after another, by the split whose longest lane is shortest. What each took in a
# fresh clone's run at 4e660fb (2026-12-07; the host's unit, kernel and e2e tests beside the
# first guests; the RT guests in two lanes of their own).
EXPECTED = {"6.1-rt": 711, "6.1-rt.tp": 699, "6.1-rt.tls": 459, "5.10": 1091, "6.12": 987, "6.1": 343,
            "6.1.tp": 314, "6.1-arm64": 207, "6.12-arm64": 281}
# Guests whose tests mostly wait, given WAITING_LANES lanes of their own beside the --jobs lanes
# (when there are two or more): PREEMPT_RT's. In CI's run at b4d89a4 (two lanes) its qemu used
# 210 CPU-s of the host in 464 s and 270 in 849, where 6.12's used 552 in 651. Its tests wait in
# the kernel: a sample of the guest's stacks found nettap's detaching threads in
# synchronize_rcu_tasks_trace (each perf-event link's release, perf_event_detach_bpf_prog); of
# the matrix's configs only RT's has TASKS_TRACE_RCU_READ_MB, whose grace periods wait on the
# clock rather than on IPIs, and boot parameters (rcupdate.rcu_task_ipi_delay=0,
# rcu_expedited=1, rcu_normal_after_boot=0) left a test's detach at 3.3 s. Their CPU-light lane
# overlaps the others instead of following them: the test command took 1,697 s where it took
# 2,106 in two lanes (the stage tables). One such lane (6.1-rt.tp, then 6.1-rt) ran 1,621 s at
# ec7fd77 with 587 CPU-s, longer than either busy lane; its tracepoint-mode tests are now two
# shards (the TLS modules' and the rest) and its guests two lanes: at 4e660fb they ended at
# 1,170 s, the busy lanes at 1,612, the test command at 1,686 s (1,838 at ec7fd77).
WAITING = ("6.1-rt", "6.1-rt.tp", "6.1-rt.tls")
WAITING_LANES = 2
# The whole matrix must end inside CI's 90 minutes, with the host's own run (~9 min) before it:
# no guest gets more than what is left of this. pytest in the guest is interrupted (SIGINT)
# this long before its guest's end, so it still writes its junit xml and names its test.
BUDGET = 4500
PYTEST_GRACE = 150
BOOT_ATTEMPTS = 2                      # a guest whose kernel died before the tests started: once more
GUESTS = []                            # every vng started, to kill on timeout or interrupt
STOP = threading.Event()               # interrupted: the lanes boot no more guests
MARK = ".nettap-kernel-matrix"         # marks a /lib/modules/<release> this script created
ENV = dict(os.environ, DEBIAN_FRONTEND="noninteractive",
           PATH=f"{REPO}/.venv/bin:/usr/sbin:/sbin:{os.environ.get('PATH', '/usr/bin:/bin')}")


def log(msg):
    print(f"kernel-matrix: {msg}", file=sys.stderr, flush=True)


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, env=ENV, **kw)


def newest_package(regex):
    out = subprocess.run(["apt-cache", "search", "--names-only", regex], env=ENV,
                         capture_output=True, text=True, check=True).stdout
    names = [line.split(" - ")[0] for line in out.splitlines()]
    natural = lambda n: [int(x) for x in re.findall(r"\d+", n)]
    return max(names, key=natural) if names else None


def add_backports():
    """Add bookworm-backports from the mirror apt already uses for bookworm."""
    out = subprocess.run(["apt-get", "indextargets", "--format", "$(REPO_URI) $(RELEASE)",
                          "Identifier: Packages"], env=ENV, capture_output=True, text=True).stdout
    uris = [l.split()[0] for l in out.splitlines() if l.endswith(" bookworm")]
    if not uris:
        raise RuntimeError("no bookworm apt source to derive bookworm-backports from")
    with open("/etc/apt/sources.list.d/bookworm-backports.sources", "w") as f:
        f.write(f"Types: deb\nURIs: {uris[0]}\nSuites: bookworm-backports\nComponents: main\n"
                "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")
    log(f"added bookworm-backports ({uris[0]})")
    run(["apt-get", "update", "-qq"])


def resolve(regex, updated):
    """The newest package matching regex; apt-get update (once) and backports if needed."""
    pkg = newest_package(regex)
    if pkg is None and not updated[0]:
        run(["apt-get", "update", "-qq"])
        updated[0] = True
        pkg = newest_package(regex)
    if pkg is None and "+deb12" in regex and not os.path.exists(
            "/etc/apt/sources.list.d/bookworm-backports.sources"):
        add_backports()
        pkg = newest_package(regex)
    if pkg is None:
        raise RuntimeError(f"no package matches {regex}")
    return pkg


def security_mirror():
    out = subprocess.run(["apt-get", "indextargets", "--format", "$(REPO_URI) $(RELEASE)",
                          "Identifier: Packages"], env=ENV, capture_output=True, text=True).stdout
    uris = [l.split()[0] for l in out.splitlines() if l.endswith("-security")]
    if not uris:
        raise RuntimeError("no Debian security apt source to find other suites on")
    return uris[0].rstrip("/") + "/"


def resolve_in_suite(regex, suite, arch="amd64"):
    """(package, URL of its .deb): the newest match in suite's main/binary-<arch> index."""
    base = security_mirror()
    with urllib.request.urlopen(f"{base}dists/{suite}/main/binary-{arch}/Packages.xz", timeout=60) as r:
        index = lzma.decompress(r.read()).decode()
    found = {}
    for stanza in index.split("\n\n"):
        fields = dict(l.split(": ", 1) for l in stanza.splitlines() if ": " in l and not l[0].isspace())
        if re.match(regex, fields.get("Package", "")):
            found[fields["Package"]] = base + fields["Filename"]
    if not found:
        raise RuntimeError(f"no package matches {regex} in {suite}")
    natural = lambda n: [int(x) for x in re.findall(r"\d+", n)]
    pkg = max(found, key=natural)
    return pkg, found[pkg]


def fetch(pkg, regex, cache, url=None):
    """Download (apt-get download, or url) and unpack pkg into cache/<pkg>/ once; drop older
    kernels of the same flavour."""
    tree = os.path.join(cache, pkg)
    if not os.path.exists(os.path.join(tree, ".unpacked")):
        tmp = os.path.join(cache, ".download")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        shutil.chown(tmp, "_apt")      # apt downloads as _apt, and warns when it cannot
        log(f"downloading {pkg}")
        if url:
            urllib.request.urlretrieve(url, os.path.join(tmp, os.path.basename(url)))
        else:
            run(["apt-get", "download", "-q", pkg], cwd=tmp, stdout=subprocess.DEVNULL)
        shutil.rmtree(tree, ignore_errors=True)
        deb, = os.listdir(tmp)
        run(["dpkg-deb", "-x", os.path.join(tmp, deb), tree])
        shutil.rmtree(tmp)
        open(os.path.join(tree, ".unpacked"), "w").close()
    for old in os.listdir(cache):
        if old != pkg and re.match(regex, old):
            shutil.rmtree(os.path.join(cache, old))
    release = pkg[len("linux-image-"):-len("-unsigned")]
    if not os.path.isdir(os.path.join(tree, "lib/modules", release)):
        raise RuntimeError(f"{pkg} has no lib/modules/{release}")
    return tree, release


def install_modules(tree, release):
    """/lib/modules/<release> = the package's modules + its vmlinuz (where `vng -r <release>`
    looks), depmod'ed so modprobe works in the guest. Returns the dir if we created it."""
    dst = f"/lib/modules/{release}"
    if os.path.exists(dst) and not os.path.exists(os.path.join(dst, MARK)):
        return None                    # the host has this kernel installed: use it, leave it
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs("/lib/modules", exist_ok=True)
    src = os.path.join(tree, "lib/modules", release)
    # hard links when the cache is on the same filesystem: instant, no extra space
    if subprocess.run(["cp", "-al", src, dst], stderr=subprocess.DEVNULL).returncode != 0:
        shutil.rmtree(dst, ignore_errors=True)
        run(["cp", "-a", src, dst])
    open(os.path.join(dst, MARK), "w").close()
    shutil.copy(os.path.join(tree, "boot", f"vmlinuz-{release}"), os.path.join(dst, "vmlinuz"))
    run(["depmod", release])
    return dst


# What Python reads in a guest, packed once on the host into a file system image the guests
# mount read-only from a virtio disk (scripts/kernel_matrix.py pack): over the guest's 9p root
# every file lookup of an import is emulated, and `import pytest` alone took 25 s in the 5.10
# guest; unpacking the same files from a tar over 9p into tmpfs took 26-121 s a guest (the
# emulated copy of 116 MiB), mounting the image takes under a second and reads only what is
# imported. Left out: what no kernel test imports (the static libpython, pip, setuptools,
# virtme-ng, jsonnet, the linter's 24 MB binary, Helm's engine, tests of the libraries, the Go test
# programs only unit tests run).
TREE = "guest-tree.img"
STDLIB = f"/usr/lib/python{sys.version_info[0]}.{sys.version_info[1]}"
TREE_EXCLUDE = ["config-*-linux-gnu", "lib2to3", "pydoc_data", "idlelib", "tkinter", "ensurepip",
                "turtledemo", "site-packages/pip", "site-packages/setuptools", "site-packages/pkg_resources",
                "site-packages/virtme", "site-packages/virtme_ng", "site-packages/_jsonnet*.so",
                "site-packages/wheel", "site-packages/numpy/*/tests", ".git", "bin/ruff", "site-packages/ruff",
                # Helm's engine (helm-python-sdk, 244 MB): the chart's unit tests only
                "site-packages/helm_python",
                # the Go programs only the unit tests read (tests/gobuild.py): the kernel tests run plain,
                # stripped and pie builds
                "gotls-pie_stripped-*", "gotls-boringcrypto-*", "notls-*", ".lock", "*.tmp",
                # the arm64 guests' (scripts/arm64_guest.py packs the x86 ones out of theirs)
                "gotls-*-arm64-*"]
TREE_MOUNT = "/tmp/nettap-tree"        # in the guest (its /tmp is a writable overlay)


def pack(out):
    """out/TREE: an ext4 image (no journal) of the stdlib and the checkout with its .venv and
    compiled bytecode, at their host paths. Returns the path, or None (the guests then import
    over 9p: slower, still right)."""
    venv_py = os.path.join(REPO, ".venv/bin/python")
    dst, staging = os.path.join(out, TREE), os.path.join(out, "guest-tree")
    try:
        # the Go programs the kernel tests run (scripts/test.sh builds every one in the
        # background from its start: this waits for those alone, built or being built)
        run([venv_py, "tests/gobuild.py", "--kernel"], cwd=REPO, stdout=subprocess.DEVNULL)
        # bytecode for the checkout's own modules, so the guest compiles nothing
        run([venv_py, "-m", "compileall", "-q", "-j0", "exporter", "tests", "scripts"], cwd=REPO,
            stdout=subprocess.DEVNULL)
        # and pytest's own for the test modules (their asserts rewritten, __pycache__/*-pytest-*.pyc),
        # which a guest would otherwise make at each start and not keep: the host collects the
        # kernel tests in 0.76 s with them, 1.28 s without (2026-12-07; a guest runs Python
        # many times slower). A collection writes them; one that fails writes fewer, and the
        # guest makes the rest.
        subprocess.run([venv_py, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        *GUEST_SELECTION], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={k: v for k, v in ENV.items() if k != "PYTHONDONTWRITEBYTECODE"})
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        # (the host's tests run beside: a file they write as it is read (a .pytest_cache, a pyc
        # renamed into place) is what tar's status 1 says, no missing file: the guests need neither)
        tar = subprocess.Popen(["tar", "-cf", "-", "--warning=no-file-changed", "--warning=no-file-removed",
                                *[f"--exclude={x}" for x in TREE_EXCLUDE], "-C", "/",
                                STDLIB.lstrip("/"), REPO.lstrip("/")], stdout=subprocess.PIPE)
        run(["tar", "-xf", "-", "-C", staging], stdin=tar.stdout)
        if tar.wait() not in (0, 1):
            raise subprocess.CalledProcessError(tar.returncode, "tar -c")
        guest_image.ext4(staging, dst, "x86")
        return dst
    except (OSError, subprocess.CalledProcessError) as e:
        log(f"not packed ({e}): the guests import over 9p")
        return None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def tree_lines(tree):
    """Guest shell lines: the packed image mounted, the stdlib and the checkout bound from it."""
    if not tree:
        return ""
    m = shlex.quote(TREE_MOUNT)
    return (f"modprobe -q virtio_blk && modprobe -q ext4 && mkdir -p {m} && "
            f"mount -t ext4 -o ro /dev/vda {m} && "
            f"mount --bind {m}{shlex.quote(STDLIB)} {shlex.quote(STDLIB)} && "
            f"mount --bind {m}{shlex.quote(REPO)} {shlex.quote(REPO)} "
            f"|| echo 'kernel-matrix: mounting the packed tree failed' >&2\n")


def boot(name, release, out, timeout, pytest_args, deadline, tree=None, kernel=None):
    """Run the kernel tests in a guest; its results land in out/<name>.{release,log,rc,xml}.
    The guest gets timeout seconds, boot included, and never runs past deadline. kernel: vng's
    arguments choosing the kernel and root (default: release's, over the host's root)."""
    timeout = min(timeout, deadline - time.monotonic())
    if timeout < 2 * PYTEST_GRACE:
        log(f"{name}: not booted: the matrix's budget (--budget) is spent")
        return 0.0
    # stale results must not count
    for ext in ("release", "boot", "unpacked", "hold", "log", "rc", "xml", "cpu", "console.log", "console.1.log"):
        if os.path.exists(f"{out}/{name}.{ext}"):
            os.remove(f"{out}/{name}.{ext}")
    g = f"{GUEST_OUT}/{name}"
    # -v: the log names each test as it ends, so a killed guest still shows where it was
    pytest = [*GUEST_SELECTION, "-v", "-p", "no:cacheprovider", f"--junitxml={g}.xml", *pytest_args]
    stop = ["timeout", "-s", "INT", "-k", "60", str(int(timeout - PYTEST_GRACE))]
    with open(f"{out}/{name}.sh", "w") as f:
        f.write(f"cd {shlex.quote(REPO)}\n"
                f"uname -r > {g}.release\n"
                f"cut -d' ' -f1 /proc/uptime > {g}.boot\n"                # seconds to boot
                + tree_lines(tree) +
                f"cd {shlex.quote(REPO)}\n"                             # the bound tree now there
                f"cut -d' ' -f1 /proc/uptime > {g}.unpacked\n"
                # only the variant nettap would pick here: each test costs ~10x under TCG
                "export PYTHONDONTWRITEBYTECODE=1 TMPDIR=/tmp NETTAP_TEST_VARIANTS=default\n"
                # the tests' tracepoints stay registered: no jump label is rewritten (see the script)
                "mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing\n"
                f".venv/bin/python scripts/hold_tracepoints.py 2> {g}.hold & hold=$!\n"
                # nothing else runs while it switches the labels on (6.12 once hit the int3 of
                # the syscall exit label in pytest's start-up, in the middle of that rewrite)
                f"while kill -0 $hold 2>/dev/null && ! grep -q holding {g}.hold; do sleep 0.2; done\n"
                f"{shlex.join(stop)} .venv/bin/python -m pytest {shlex.join(pytest)} > {g}.log 2>&1\n"
                f"echo $? > {g}.rc\n"
                "kill $hold\n")
    # --verbose: the guest has no udev, so no /dev/virtio-ports links for vng's script I/O;
    # virtme-ng-init then runs the command on the serial console, which only --verbose shows.
    qemu = QEMU_OPTS + ("" if kernel else f" -cpu {X86_CPU}") \
        + (f" -drive file={tree},if=virtio,format=raw,readonly=on" if tree else "")
    cmd = ["vng", "--verbose", "--disable-kvm", "--force-9p", "--cpus", "2", "--memory", "2G",
           "--rwdir", f"{GUEST_OUT}={out}", *(kernel or ["-r", release]), f"--qemu-opts={qemu}", "--", f"sh {g}.sh"]
    start = time.monotonic()
    for attempt in range(1, BOOT_ATTEMPTS + 1):
        log(f"{name}: booting {release}")
        with open(f"{out}/{name}.console.log", "w") as console:
            # own session: on timeout kill vng, virtme-run and qemu together
            p = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdin=subprocess.DEVNULL, stdout=console,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            GUESTS.append(p)
            if STOP.is_set():          # interrupted as it started: main's finally may have missed it
                kill(p)
            try:
                cpu = wait_cpu(p, max(1.0, timeout - (time.monotonic() - start)))
                with open(f"{out}/{name}.cpu", "w") as f:
                    f.write(f"{cpu:.1f}\n")
            except subprocess.TimeoutExpired:
                log(f"{name}: guest still running after {timeout} s, killed")
            finally:
                kill(p)
        # The kernel died before the tests started (no .release, or pytest
        # wrote nothing): an emulated kernel can panic while it patches its
        # own text (6.12.118 did, once in a few boots: an int3 Oops at boot,
        # and once as the syscall tracepoints were switched on before the
        # tests). That is no test result: boot again while time is left,
        # keeping the failed boot's console.
        log_path = f"{out}/{name}.log"
        started = os.path.exists(f"{out}/{name}.release") and os.path.exists(log_path) \
            and os.path.getsize(log_path) > 0
        if started or STOP.is_set() or attempt == BOOT_ATTEMPTS \
                or timeout - (time.monotonic() - start) < 2 * PYTEST_GRACE:
            break
        os.replace(f"{out}/{name}.console.log", f"{out}/{name}.console.{attempt}.log")
        for ext in ("release", "boot", "unpacked", "hold", "log", "rc", "xml"):
            if os.path.exists(f"{out}/{name}.{ext}"):
                os.remove(f"{out}/{name}.{ext}")
        log(f"{name}: the guest did not start the tests (see {out}/{name}.console.{attempt}.log): "
            f"booting again")
    took = time.monotonic() - start
    log(f"{name}: done in {took:.0f} s")
    return took


def prepare(name, regex, suite, cache, updated):
    """(release, the /lib/modules dir made for it or None): kernel name fetched and installed
    where its guest boots it (an arm64 kernel's modules go into the arm64 root)."""
    if name in ARCHES:
        pkg, url = resolve_in_suite(regex, suite, ARCHES[name])
        tree, release = fetch(pkg, regex, cache, url)
        arm64_guest.install_modules(tree, release, arm64_root(cache))
        return release, None
    if suite:
        pkg, url = resolve_in_suite(regex, suite)
        tree, release = fetch(pkg, regex, cache, url)
        return release, install_modules(tree, release)
    try:
        tree, release = fetch(resolve(regex, updated), regex, cache)
    except subprocess.CalledProcessError:
        if updated[0]:
            raise
        run(["apt-get", "update", "-qq"])     # stale lists: a superseded version
        updated[0] = True
        tree, release = fetch(resolve(regex, updated), regex, cache)
    return release, install_modules(tree, release)


def arm64_root(cache):
    """The arm64 guests' root file system, built once per run (and cached)."""
    if not hasattr(arm64_root, "path"):
        arm64_root.path = arm64_guest.root(cache)
    return arm64_root.path


def guest_jobs(ready):
    """(guest name, release, pytest -k or None) of each guest to boot: a kernel's shards, or the kernel."""
    return [(g, release, k) for name, release in ready
            for g, k in SHARDS.get(name, [(name, SUBSETS.get(name))])]


def with_k(pytest_args, k):
    """pytest_args selecting also by -k k (a -k given in them is and-ed: pytest keeps only its last)."""
    if not k:
        return list(pytest_args)
    args = list(pytest_args)
    for i, arg in enumerate(args[:-1]):
        if arg == "-k":
            args[i + 1] = f"({args[i + 1]}) and ({k})"
            return args
    return args + ["-k", k]


def lanes(jobs, n):
    """jobs split into n lanes, each longest first, by the split whose longest lane (EXPECTED
    seconds; an unknown guest counts as the longest known) is shortest; with n > 1 the WAITING
    guests in WAITING_LANES lanes of their own, beside."""
    cost = {j[0]: EXPECTED.get(j[0], max(EXPECTED.values())) for j in jobs}
    waiting = [j for j in jobs if j[0] in WAITING] if n > 1 else []
    if waiting and len(waiting) < len(jobs):
        return lanes([j for j in jobs if j not in waiting], n) + lanes(waiting, WAITING_LANES)
    best, best_t = None, None
    for assign in itertools.product(range(n), repeat=len(jobs)):
        t = max(sum(cost[j[0]] for j, a in zip(jobs, assign) if a == i) for i in range(n))
        if best_t is None or t < best_t:
            best, best_t = assign, t
    out = [[j for j, a in zip(jobs, best) if a == i] for i in range(n)]
    return [sorted(lane, key=lambda j: -cost[j[0]]) for lane in out if lane]


def wait_cpu(p, timeout):
    """Wait for p (subprocess.TimeoutExpired after timeout seconds); the CPU
    seconds it and the children it waited for used (vng, qemu): how much of
    this host a guest kept busy (its tests' waits on the clock leave it idle)."""
    end = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
            p.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime
        if time.monotonic() > end:
            raise subprocess.TimeoutExpired(p.args, timeout)
        time.sleep(0.5)


def kill(p):
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def count(junit):
    """{mechanism: [passed, failed, skipped]} of the tests under tests/kernel in a junit file."""
    counts = {}
    for case in ET.parse(junit).iter("testcase"):
        if not case.get("classname", "").startswith("tests.kernel."):
            continue
        params = re.search(r"\[(.*)\]$", case.get("name", ""))
        parts = params.group(1).split("-") if params else []
        mech = next((m for m in MECHANISMS if m in parts), "any")
        mech += next((f" ({v})" for v in VARIANTS if v in parts), "")
        c = counts.setdefault(mech, [0, 0, 0])
        if case.find("failure") is not None or case.find("error") is not None:
            c[1] += 1
        elif case.find("skipped") is not None:
            c[2] += 1
        else:
            c[0] += 1
    return counts


def slowest(junit, n=SLOWEST):
    """([(seconds, idle seconds, test id)] of the n slowest tests in a junit file, setup and
    teardown included (junit's time is the three together), (seconds, idle) of them all):
    idle is what the guest's CPUs spent waiting (tests/kernel/conftest.py's idle_s,
    CPU-seconds summed over its two vCPUs: about the test's own time where one vCPU was busy
    throughout, as most tests keep one; twice it where the test only waited on the clock)."""
    cases = []
    for c in ET.parse(junit).iter("testcase"):
        idle = next((float(p.get("value")) for p in c.iter("property") if p.get("name") == "idle_s"), 0.0)
        cases.append((float(c.get("time") or 0), idle, f"{c.get('classname', '')}::{c.get('name', '')}"))
    return sorted(cases, reverse=True)[:n], (sum(c[0] for c in cases), sum(c[1] for c in cases))


def verdict(name, release, out):
    """(counts, note) of a finished guest; a note means the kernel failed."""
    booted, rc = read(f"{out}/{name}.release"), read(f"{out}/{name}.rc")
    if booted is None:
        return {}, f"guest did not run the tests (see {out}/{name}.console.log)"
    if booted != release:
        return {}, f"booted {booted}, not {release}"
    if not os.path.exists(f"{out}/{name}.xml"):
        return {}, f"no junit xml (pytest rc {rc}; see {out}/{name}.log, .console.log)"
    try:
        counts = count(f"{out}/{name}.xml")
    except ET.ParseError as e:
        return {}, f"unreadable junit xml ({e})"
    shard = any(g == name for shards in SHARDS.values() for g, _k in shards)
    if shard and rc == "5" and not counts:     # a caller's -k left this shard nothing: not a failure
        return counts, ""
    if rc != "0":
        return counts, f"pytest rc {rc} (see {out}/{name}.log)"
    return counts, "" if counts else "no kernel tests ran"


def main():
    argv = sys.argv[1:]
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/nettap-kernel-matrix", help="results dir (shared with guests)")
    ap.add_argument("--cache", default="/var/cache/nettap-kernels", help="downloaded kernels")
    ap.add_argument("--host-junit", help="junit xml of the host's run, shown as its own row")
    ap.add_argument("--table", help="markdown table (default OUT/kernel-matrix.md)")
    # 6.12's guest ran its tests in ~13 min here beside other work; the RT guest takes longest.
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per guest, boot included")
    ap.add_argument("--budget", type=int, default=BUDGET, help="seconds for every guest together")
    ap.add_argument("--jobs", type=int, default=JOBS, help="guests booted at once")
    a = ap.parse_args(argv)
    deadline = time.monotonic() + a.budget
    if os.geteuid() != 0:
        sys.exit("kernel-matrix: needs root (apt-get, /lib/modules, qemu)")
    if shutil.which("vng", path=ENV["PATH"]) is None:
        sys.exit("kernel-matrix: vng not found: run scripts/setup.sh test")
    out = os.path.abspath(a.out)
    table = a.table or os.path.join(out, "kernel-matrix.md")
    os.makedirs(out, exist_ok=True)
    os.makedirs(a.cache, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # so `finally` cleans up

    rows = {}                          # name -> (release, counts, note, seconds)
    if os.path.exists(f"{out}/guests.tsv"):
        os.remove(f"{out}/guests.tsv")
    ready, created, updated = [], [], [False]
    had_modules_dir = os.path.isdir("/lib/modules")   # this host's own kernel ships none
    try:
        only = [k for k in os.environ.get("NETTAP_MATRIX_KERNELS", "").split(",") if k]
        for name, regex, suite in KERNELS:
            if only and name not in only:      # a developer's partial run (never CI's)
                rows[name] = (name, {}, "not run (NETTAP_MATRIX_KERNELS)", "")
                continue
            try:
                release, d = prepare(name, regex, suite, a.cache, updated)
                created += [d] if d else []
                ready.append((name, release))
            except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
                rows[name] = (name, {}, f"fetch/install failed: {e}", "")
        tree = pack(out) if any(n not in ARCHES for n, _r in ready) else None
        trees, packing = {}, threading.Lock()     # arch -> its guests' packed tree

        def arch_tree(arch):
            """The arm64 guests' tree, packed by the lane that first boots one (beside the x86
            guests already running, not before them); raises if it could not be packed."""
            with packing:
                if arch not in trees:
                    try:
                        trees[arch] = arm64_guest.pack(out, a.cache, arm64_root(a.cache), REPO, TREE_EXCLUDE,
                                                       f"guest-tree-{arch}.img")
                    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
                        trees[arch] = RuntimeError(f"its packed tree failed: {e}")
                if isinstance(trees[arch], Exception):
                    raise trees[arch]
                return trees[arch]
        jobs = guest_jobs(ready)
        began, took = {}, {}           # name -> wall clock at its boot (guests overlap: stages.py)

        def run_lane(lane):
            for name, release, k in lane:
                if STOP.is_set():
                    return
                began[name] = time.time()
                arch = ARCHES.get(name)            # (an arm64 kernel has no shards)
                try:
                    kernel = arm64_guest.vng_args(arm64_root(a.cache), release) if arch else None
                    took[name] = boot(name, release, out, a.timeout, with_k(pytest_args, k), deadline,
                                      arch_tree(arch) if arch else tree, kernel)
                except Exception as e:      # this guest fails (verdict says how); the lane goes on
                    took[name] = time.time() - began[name]
                    print(f"kernel-matrix: {name}: {type(e).__name__}: {e}", flush=True)
        threads = [threading.Thread(target=run_lane, args=(lane,)) for lane in lanes(jobs, max(1, a.jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for name, release, _k in jobs:
            rows[name] = report_guest(name, release, out, took[name], began.get(name, ""))
    finally:
        STOP.set()
        for p in GUESTS:               # interrupted: stop the guests before their modules go
            kill(p)
        for d in created:              # leave no kernel of ours behind on the host
            shutil.rmtree(d, ignore_errors=True)
        if not had_modules_dir and os.path.isdir("/lib/modules") and not os.listdir("/lib/modules"):
            os.rmdir("/lib/modules")

    sys.exit(1 if write_table(rows, a.host_junit, table) else 0)


def report_guest(name: str, release: str, out: str, took: float, began) -> tuple:
    """A guest's row (release, counts, note, time); its line in guests.tsv, and
    what it printed when it failed, and its slowest tests, on stdout."""
    counts, note = verdict(name, release, out)
    up, cpu = read(f"{out}/{name}.boot"), read(f"{out}/{name}.cpu")
    t = f"{took:.0f} s" + (f" (boot {float(up):.0f} s)" if up else "")
    with open(f"{out}/guests.tsv", "a") as f:   # scripts/stages.py's table
        f.write(f"{name}\t{float(up) if up else ''}\t{took:.1f}\t{began}\t{cpu or ''}\n")
    if note and os.path.exists(f"{out}/{name}.log"):    # a failure: all it said
        print(f"--- {name} ({release}): pytest in the guest\n{read(f'{out}/{name}.log')}")
    if os.path.exists(f"{out}/{name}.xml"):
        try:
            top, (tests, idle) = slowest(f"{out}/{name}.xml")
        except ET.ParseError:
            top, tests, idle = [], 0.0, 0.0
        print(f"--- {name} ({release}): {took:.0f} s, the host's CPU {cpu or '?'} s; its tests {tests:.0f} s, "
              f"their CPUs idle {idle:.0f} CPU-s; the {len(top)} slowest tests (setup + call + teardown, idle)")
        for sec, idle, test in top:
            print(f"{sec:8.1f} s {idle:6.1f}  {test}")
    return release, counts, note, t


def write_table(rows: dict, host_junit, table: str) -> bool:
    """The matrix's table (printed, and written to table), the guests in
    KERNELS' order, the host's run first; True when a guest failed."""
    rows = [rows[g] for n, _, _ in KERNELS for g, _k in SHARDS.get(n, [(n, None)]) if g in rows]
    if host_junit:
        counts = count(host_junit) if os.path.exists(host_junit) else {}
        rows.insert(0, (f"{os.uname().release} (host)", counts,
                        "" if counts else "no kernel tests in the host run", ""))
    lines = ["| kernel | mechanism (variant) | passed | failed | skipped | time | note |",
             "|---|---|---:|---:|---:|---:|---|"]
    total, failed = [0, 0, 0], False
    for release, counts, note, t in rows:
        for i, (mech, c) in enumerate(sorted(counts.items()) or [("-", ["", "", ""])]):
            lines.append(f"| {release} | {mech} | {c[0]} | {c[1]} | {c[2]} | "
                         + (f"{t} | {note} |" if i == 0 else " | |"))
        if "(host)" not in release:   # the host's failures fail its own pytest run
            failed |= bool(note) or any(c[1] for c in counts.values())
            total = [x + sum(c[i] for c in counts.values()) for i, x in enumerate(total)]
    with open(table, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines) + f"\n(table written to {table})")
    print(f"matrix: {total[0]} passed, {total[1]} failed, {total[2]} skipped")   # the closing line
    return failed


if __name__ == "__main__":
    main()
