"""The kernel matrix's arm64 guests (scripts/kernel_matrix.py imports this): Debian's arm64
kernels under qemu-system-aarch64 (TCG), booted by virtme-ng over an arm64 root file system
instead of the host's, with nettap's checkout, an arm64 venv and the root's stdlib packed into
an ext4 image as the x86 guests' are.

    root(cache)                 Debian bookworm's arm64 packages a kernel test needs (PACKAGES),
                                unpacked by `mmdebstrap --variant=extract`: no maintainer script
                                runs, so no qemu-user and ~10 s; then the few files those scripts
                                would have written. Cached under cache/ by the list's hash.
    install_modules(tree, rel, root)
                                the kernel package's modules into the root (where virtme-ng looks
                                with --root), depmod'ed
    pack(out, cache, root, ...) the image: the checkout (its x86 .venv left out) with an arm64
                                .venv (the root's python3.11, PyPI's aarch64 wheels of the versions
                                the checkout's .venv has, nettap's C extensions cross-compiled by
                                gcc-aarch64-linux-gnu against the root's headers) and the root's
                                /usr/lib/python3.11

Everything is built from Debian's and PyPI's packages on the x86-64 host in under a minute with a
cold cache; nothing is emulated but the guest itself.
"""
import glob
import hashlib
import os
import shutil
import subprocess
import sys

import guest_image

ARCH = "arm64"                          # Debian's and virtme-ng's name; uname -m says aarch64
# What the kernel tests the arm64 guests run need from the root (apart from the venv): a shell
# and coreutils for virtme-ng's init and the guest script, busybox for its initramfs and its
# poweroff, python3 (3.11, as the host's), libbpf1, the tools the tests run (ip, nft, openssl,
# curl, setpriv, unshare, mount), numpy's libstdc++ and libpython3.11-dev, whose headers (with libc6-dev's) the C
# extensions are cross-compiled against.
PACKAGES = ["base-files", "base-passwd", "bash", "coreutils", "dash", "diffutils", "findutils", "grep",
            "gzip", "sed", "tar", "util-linux", "mount", "procps", "kmod", "busybox-static", "libc-bin",
            "python3", "libpython3.11-dev", "libbpf1", "iproute2", "nftables", "openssl", "ca-certificates",
            "curl", "libstdc++6"]
SUITE = "bookworm"
ROOT_FORMAT = 3                         # what root() does after unpacking: a change rebuilds the cached root
# The venv's packages: nettap's dependencies and what the kernel tests import, at the versions the
# host's .venv has (pip freeze), as aarch64 wheels (all of them publish one, or are pure Python).
VENV_PACKAGES = ["prometheus-client", "numpy", "PyYAML", "bcrypt", "dpkt", "rich", "requests", "urllib3",
                 "nats-py", "dnspython", "pyelftools", "capstone", "pytest", "pyroute2"]
WHEEL_PLATFORMS = ["manylinux_2_28_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64", "linux_aarch64"]
PY = f"{sys.version_info[0]}.{sys.version_info[1]}"
STDLIB = f"/usr/lib/python{PY}"
CROSS_CC = "aarch64-linux-gnu-gcc"
EXT_SUFFIX = f".cpython-{sys.version_info[0]}{sys.version_info[1]}-aarch64-linux-gnu.so"


def log(msg):
    print(f"kernel-matrix: {msg}", file=sys.stderr, flush=True)


def _run(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def _key(*parts) -> str:
    return hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()[:12]


def root(cache: str) -> str:
    """cache/arm64-root-<hash>: the arm64 root file system (built once per package list)."""
    path = os.path.join(cache, f"{ARCH}-root-{_key(ROOT_FORMAT, SUITE, *PACKAGES)}")
    if os.path.exists(os.path.join(path, ".built")):
        return path
    for old in glob.glob(os.path.join(cache, f"{ARCH}-root-*")):
        shutil.rmtree(old, ignore_errors=True)
    log(f"building the {ARCH} root file system ({len(PACKAGES)} packages of Debian {SUITE})")
    _run(["mmdebstrap", "-q", "--variant=extract", f"--architectures={ARCH}", f"--include={','.join(PACKAGES)}",
          SUITE, path], stdout=subprocess.DEVNULL)
    # What the packages' maintainer scripts would have made, and virtme-ng's init expects:
    # the user database (base-passwd's masters), the mount points it binds, a poweroff
    for d in ("opt", "srv", "etc/lvm", "lib/modules"):
        os.makedirs(os.path.join(path, d), exist_ok=True)
    for name in ("passwd", "group"):
        shutil.copy(os.path.join(path, f"usr/share/base-passwd/{name}.master"), os.path.join(path, "etc", name))
    with open(os.path.join(path, "etc/shadow"), "w") as f:
        f.write("root:*:19000:0:99999:7:::\n")
    # /var/run and /var/lock are /run's, as on a booted Debian (ip netns finds pyroute2's namespaces)
    for link, to in (("var/run", "/run"), ("var/lock", "/run/lock")):
        shutil.rmtree(os.path.join(path, link))
        os.symlink(to, os.path.join(path, link))
    for tool in ("poweroff", "reboot"):
        os.symlink("/bin/busybox", os.path.join(path, "sbin", tool))
    open(os.path.join(path, ".built"), "w").close()
    return path


def install_modules(tree: str, release: str, rootfs: str) -> None:
    """The kernel package's modules and vmlinuz under rootfs/lib/modules/<release>, depmod'ed
    (hard links: the cache and the root share a file system)."""
    dst = os.path.join(rootfs, "lib/modules", release)
    if os.path.exists(os.path.join(dst, "modules.dep")):
        return
    shutil.rmtree(dst, ignore_errors=True)
    src = os.path.join(tree, "lib/modules", release)
    if subprocess.run(["cp", "-al", src, dst], stderr=subprocess.DEVNULL).returncode != 0:
        shutil.rmtree(dst, ignore_errors=True)
        _run(["cp", "-a", src, dst])
    shutil.copy(os.path.join(tree, "boot", f"vmlinuz-{release}"), os.path.join(dst, "vmlinuz"))
    _run(["depmod", "-b", rootfs, release])


def _pins(repo: str) -> list:
    """VENV_PACKAGES at the versions of repo's .venv."""
    out = subprocess.run([os.path.join(repo, ".venv/bin/python"), "-m", "pip", "freeze"], capture_output=True,
                         text=True, check=True).stdout
    have = {line.split("==")[0].lower().replace("_", "-"): line.strip() for line in out.splitlines() if "==" in line}
    missing = [p for p in VENV_PACKAGES if p.lower() not in have]
    if missing:
        raise RuntimeError(f"the checkout's .venv lacks {', '.join(missing)}: run scripts/setup.sh test")
    return [have[p.lower()] for p in VENV_PACKAGES]


def site(cache: str, repo: str) -> str:
    """cache/arm64-site-<hash>: the venv's site-packages as aarch64 wheels, pinned to repo's .venv."""
    pins = _pins(repo)
    path = os.path.join(cache, f"{ARCH}-site-{_key(PY, *pins)}")
    if os.path.exists(os.path.join(path, ".built")):
        return path
    for old in glob.glob(os.path.join(cache, f"{ARCH}-site-*")):
        shutil.rmtree(old, ignore_errors=True)
    log(f"fetching {len(pins)} packages' aarch64 wheels")
    plat = [a for p in WHEEL_PLATFORMS for a in ("--platform", p)]
    p = subprocess.run([os.path.join(repo, ".venv/bin/python"), "-m", "pip", "install", "-q",
                        "--disable-pip-version-check", "--no-warn-script-location", "--target", path, *plat,
                        "--python-version", PY, "--implementation", "cp", "--only-binary=:all:", *pins],
                       capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"pip could not fetch the aarch64 wheels: {p.stderr[-2000:]}")
    open(os.path.join(path, ".built"), "w").close()
    return path


def extensions(repo: str, rootfs: str, dst: str) -> None:
    """nettap's C extensions (setup.py's) for aarch64 under dst (the checkout's layout)."""
    tmp = dst + ".tmp"
    cc = f"{CROSS_CC} --sysroot={rootfs}"
    env = dict(os.environ, CC=cc, LDSHARED=f"{cc} -shared", SETUPTOOLS_EXT_SUFFIX=EXT_SUFFIX)
    try:
        _run([os.path.join(repo, ".venv/bin/python"), "setup.py", "-q", "build_ext", "--build-lib", dst,
              "--build-temp", tmp], cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"cross-compiling the C extensions failed: {e.stderr.decode()[-2000:]}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if len(glob.glob(os.path.join(dst, "exporter/*/*" + EXT_SUFFIX))) < 3:
        raise RuntimeError(f"cross-compiling left no {EXT_SUFFIX} files")


def pack(out: str, cache: str, rootfs: str, repo: str, exclude: list, name: str) -> str:
    """out/name: the arm64 guests' ext4 image (see the module's doc). Raises on failure: an arm64
    guest without its venv cannot run a test."""
    sitedir = site(cache, repo)
    # the Go programs the kernel tests run, for arm64 (the root has no Go; built once, cached)
    _run([os.path.join(repo, ".venv/bin/python"), "tests/gobuild.py", "--kernel", ARCH], cwd=repo,
         stdout=subprocess.DEVNULL)
    exclude = [x for x in exclude if ARCH not in x] + ["gotls-*-amd64-*"]
    os.makedirs(os.path.join(rootfs, repo.lstrip("/")), exist_ok=True)    # where the guest binds it
    dst, staging = os.path.join(out, name), os.path.join(out, name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        here = os.path.join(staging, repo.lstrip("/"))
        os.makedirs(here)
        # (tar's status 1: a file the host's tests wrote as it was read; see kernel_matrix.pack)
        tar = subprocess.Popen(["tar", "-cf", "-", "--warning=no-file-changed", "--warning=no-file-removed",
                                *[f"--exclude={x}" for x in exclude], "--exclude=./.venv",
                                "--exclude=*-x86_64-linux-gnu.so", "-C", repo, "."], stdout=subprocess.PIPE)
        _run(["tar", "-xf", "-", "-C", here], stdin=tar.stdout)
        if tar.wait() not in (0, 1):
            raise subprocess.CalledProcessError(tar.returncode, "tar -c")
        extensions(repo, rootfs, here)
        venv = os.path.join(here, ".venv")
        sp = os.path.join(venv, f"lib/python{PY}/site-packages")
        shutil.copytree(sitedir, sp, ignore=shutil.ignore_patterns(".built", "bin"), symlinks=True)
        with open(os.path.join(sp, "nettap.pth"), "w") as f:
            f.write(repo + "\n")                # the checkout, as the host's editable install
        os.makedirs(os.path.join(venv, "bin"))
        for exe in ("python", "python3", f"python{PY}"):
            os.symlink(f"/usr/bin/python{PY}", os.path.join(venv, "bin", exe))
        with open(os.path.join(venv, "pyvenv.cfg"), "w") as f:
            f.write(f"home = /usr/bin\ninclude-system-site-packages = false\nversion = {PY}\n")
        shutil.copytree(os.path.join(rootfs, STDLIB.lstrip("/")), os.path.join(staging, STDLIB.lstrip("/")),
                        symlinks=True, ignore=shutil.ignore_patterns("test", "idlelib", "tkinter", "turtledemo",
                                                                     "ensurepip", "lib2to3", "pydoc_data"))
        guest_image.ext4(staging, dst, ARCH)
        return dst
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def vng_args(rootfs: str, release: str) -> list:
    """virtme-ng's arguments for an arm64 guest of release (its vmlinuz next to its modules)."""
    return ["--arch", ARCH, "--root", rootfs, "-r", os.path.join(rootfs, "lib/modules", release, "vmlinuz")]
