#!/bin/sh
# Set up a fresh Debian machine for nettap: Debian packages, then .venv.
#   scripts/setup.sh run    what running nettap needs
#   scripts/setup.sh test   that, plus what building and testing it needs
# Safe to run again: it installs only what is missing.
set -eu
profile=${1:-run}
cd "$(dirname "$0")/.."

RUN_PKGS="libbpf1 python3 python3-venv"
TEST_PKGS="$RUN_PKGS make clang llvm bpftool libbpf-dev linux-libc-dev iproute2 prometheus prometheus-alertmanager jsonnet"
# The kernel matrix (scripts/kernel_matrix.py): qemu for the guests, depmod for their modules,
# busybox for the initramfs virtme-ng builds to load 9p and virtio modules.
TEST_PKGS="$TEST_PKGS qemu-system-x86 kmod busybox-static"
case $profile in
  run) pkgs=$RUN_PKGS ;;
  test) pkgs=$TEST_PKGS ;;
  *) echo "usage: $0 run|test" >&2; exit 2 ;;
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
stamp=".venv/.nettap-$profile-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  [ -x .venv/bin/python ] || $PY -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check -e ".$extras"
  rm -f .venv/.nettap-*
  touch "$stamp"
  [ "$profile" = test ] && touch ".venv/.nettap-run-$(sha1sum pyproject.toml | cut -c1-12)"
fi
exit 0
