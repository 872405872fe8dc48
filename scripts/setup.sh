#!/bin/sh
# Set up a fresh Debian machine for nettap: Debian packages, then .venv.
#   scripts/setup.sh run    what running nettap needs
#   scripts/setup.sh test   that, plus what building and testing it needs
#   scripts/setup.sh bench  that, plus the benchmarks' needs (nginx, matplotlib) and their
#                           C programs built into bench/out (the storm, the load generator)
# Safe to run again: it installs only what is missing.
set -eu
profile=${1:-run}
cd "$(dirname "$0")/.."

# gcc, libc6-dev and python3-dev build the compiled modules (the ring scan and JSON-lines
# writer, exporter/capture/*.c; ingest's line split; the per-CPU sums) when pip installs nettap.
RUN_PKGS="libbpf1 python3 python3-venv gcc libc6-dev python3-dev"
TEST_PKGS="$RUN_PKGS make clang llvm bpftool libbpf-dev linux-libc-dev iproute2 prometheus prometheus-alertmanager jsonnet"
# tshark: tests/kernel/test_read.py follows the TCP streams of `nettap read --pcap` with it
TEST_PKGS="$TEST_PKGS tshark"
# tmux: the real terminal `nettap top` is tested in (send-keys, capture-pane).
TEST_PKGS="$TEST_PKGS tmux"
# curl, openssl: tests/kernel/test_tls.py (curl's plain SSL_write/SSL_read; the test certificate)
TEST_PKGS="$TEST_PKGS curl openssl"
# golang-1.19-go: tests/gobuild.py builds the Go TLS programs of tests/go/ (goelf, the Go TLS
# uprobes) from source with Debian's toolchain
TEST_PKGS="$TEST_PKGS golang-1.19-go"
# python3-fusepy: tests/kernel/test_tls_files.py serves a libssl from a FUSE server that stalls
TEST_PKGS="$TEST_PKGS python3-fusepy"
# nats-server: the JetStream cluster nettap ingest publishes to in tests/e2e/test_ingest.py
TEST_PKGS="$TEST_PKGS nats-server"
# nftables: the retransmission tests drop packets in a network namespace of their own.
TEST_PKGS="$TEST_PKGS nftables"
# clang-format: tests/unit/test_lint.py checks bpf/ against bpf/.clang-format
TEST_PKGS="$TEST_PKGS clang-format-14"
# chromium: the landing page (/) is loaded in headless Chromium, screenshot and DOM
# (tests/e2e/test_landing.py); a font so the screenshot has text on it.
TEST_PKGS="$TEST_PKGS chromium fonts-dejavu-core"
# The kernel matrix (scripts/kernel_matrix.py): qemu for the guests, depmod for their modules,
# busybox for the initramfs virtme-ng builds to load 9p and virtio modules, mke2fs for the
# image of Python the guests mount.
TEST_PKGS="$TEST_PKGS qemu-system-x86 kmod busybox-static e2fsprogs"
# Its arm64 guests (scripts/arm64_guest.py): qemu-system-aarch64, mmdebstrap for their root file
# system (Debian's arm64 packages, unpacked: no qemu-user) and the cross-compiler for nettap's
# C extensions
TEST_PKGS="$TEST_PKGS qemu-system-arm mmdebstrap gcc-aarch64-linux-gnu"
BENCH_PKGS="$TEST_PKGS nginx"
case $profile in
  run) pkgs=$RUN_PKGS ;;
  test) pkgs=$TEST_PKGS ;;
  bench) pkgs=$BENCH_PKGS ;;
  *) echo "usage: $0 run|test|bench" >&2; exit 2 ;;
esac

missing=""
for p in $pkgs; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup: missing Debian packages:$missing (run as root, or apt-get install them)" >&2
    exit 1
  fi
  echo "setup: installing Debian packages:$missing"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # --no-install-recommends: prometheus would otherwise pull node-exporter & co.
  apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

# The virtualenv, rebuilt when pyproject.toml changes. Debian's interpreter,
# not a pyenv shim (which adds ~60 ms to every start).
PY=/usr/bin/python3
extras=""
[ "$profile" = test ] && extras="[test]"
[ "$profile" = bench ] && extras="[test,bench]"
# The stamp covers what pip builds from (the compiled modules' C sources too), and the
# modules must be there: a changed source or a cleaned tree rebuilds them.
hash=$(cat pyproject.toml setup.py exporter/*/*.[ch] | sha1sum | cut -c1-12)
stamp=".venv/.nettap-$profile-$hash"
built() { ls exporter/capture/_jsonl.*.so exporter/ingest/_split.*.so exporter/kernel/_native.*.so >/dev/null 2>&1; }
if [ ! -f "$stamp" ] || ! built; then
  [ -x .venv/bin/python ] || $PY -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check -e ".$extras"
  rm -f .venv/.nettap-*
  touch "$stamp"
  [ "$profile" != run ] && touch ".venv/.nettap-run-$hash"
  [ "$profile" = bench ] && touch ".venv/.nettap-test-$hash"
  built || { echo "setup: the compiled modules (exporter/*/*.c: _jsonl, _split, _native) did not build" >&2; exit 1; }
fi
[ "$profile" = bench ] && make -s -C bench
exit 0
