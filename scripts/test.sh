#!/bin/sh
# The README's second command (and CI's): set up what testing needs, then check
# the committed BPF objects and rendered mixin are fresh, run every test on this
# machine's kernel, then the kernel tests on Debian's stock kernels in qemu guests
# (scripts/kernel_matrix.py; its table and logs land in $NETTAP_MATRIX_OUT).
# Extra arguments go to the host's pytest, e.g. scripts/test.sh -m "not kernel and not e2e";
# NETTAP_KERNEL_MATRIX=0 leaves the guests out (a quicker local run, never CI's).
set -eu
cd "$(dirname "$0")/.."
scripts/setup.sh test
make -s -C bpf check
.venv/bin/python alerts/render.py --check
out=${NETTAP_MATRIX_OUT:-/tmp/nettap-kernel-matrix}
mkdir -p "$out"
rm -f "$out/host.xml"
rc=0
.venv/bin/python -m pytest --junitxml="$out/host.xml" "$@" || rc=$?
if [ "${NETTAP_KERNEL_MATRIX:-1}" != 0 ]; then
  /usr/bin/python3 scripts/kernel_matrix.py --out "$out" --host-junit "$out/host.xml" || rc=1
fi
exit $rc
