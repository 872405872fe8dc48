#!/bin/sh
# The README's second command (and CI's): set up what testing needs, then check
# the committed BPF objects, rendered mixin and deployment files (the PrometheusRule,
# the Helm chart's rules and config schema) are fresh, run the kernel tests on Debian's
# stock kernels in qemu guests (scripts/kernel_matrix.py; its table and logs land in
# $NETTAP_MATRIX_OUT) with every test on this machine's kernel beside them (unit, kernel,
# e2e), and end with a table of how long each stage took (scripts/stages.py).
#   scripts/test.sh                  everything (CI)
#   scripts/test.sh --kernel 6.1     set-up, checks, and that guest's kernel tests only
#                                    (a developer's loop: 5.10, 6.1, 6.1-rt, 6.12,
#                                    6.1-arm64 or 6.12-arm64)
#   scripts/test.sh -m "not e2e"     extra arguments go to the host's pytest (one run,
#                                    every tier; without them the unit tests run first,
#                                    two at a time: pytest-xdist)
# NETTAP_KERNEL_MATRIX=0 leaves the guests out (a quicker local run, never CI's).
set -eu
cd "$(dirname "$0")/.."
out=${NETTAP_MATRIX_OUT:-/tmp/nettap-kernel-matrix}
mkdir -p "$out"
rm -f "$out/host.xml" "$out/host-unit.xml" "$out/host-e2e.xml" "$out/host-e2e.rc" "$out/host-kernel.rc" \
  "$out/host-unit.rc" "$out/host-unit.took" "$out/guests.tsv"
stages="$out/stages.tsv"
mark() { printf '%s\t%s\n' "$1" "$(date +%s.%N)" >> "$stages"; }
: > "$stages"
mark start
host=1
if [ "${1:-}" = --kernel ]; then
  [ $# -ge 2 ] || { echo "usage: $0 --kernel 5.10|6.1|6.1-rt|6.12|6.1-arm64|6.12-arm64" >&2; exit 2; }
  export NETTAP_MATRIX_KERNELS="$2"
  host=0
  shift 2
fi
scripts/setup.sh test
mark set-up
# The Go test programs (tests/go, tests/gobuild.py) built beside the checks, the tests and the
# guests: with a cold Go cache the PIE and BoringCrypto builds each rebuild the standard library
# (~40 s); a test that needs one waits for it (a lock), and so does the guests' packed tree.
# arm64: the kernel matrix's arm64 guests run them too (their root has no Go)
.venv/bin/python tests/gobuild.py arm64 > "$out/gobuild.log" 2>&1 & gobuild=$!
make -s -j2 -C bpf check
.venv/bin/python mixin/render.py --check
.venv/bin/python deploy/kubernetes/render.py --check
mark checks
rc=0
if [ $host = 1 ]; then
  # nettap's tracepoints held registered for the run: closing a nettap then
  # takes 0.07 s, not 0.7 (see the script); the events go with the process
  .venv/bin/python scripts/hold_tracepoints.py 2> "$out/host.hold" & hold=$!
  trap 'kill $hold 2>/dev/null || true' EXIT
  while kill -0 $hold 2>/dev/null && ! grep -q holding "$out/host.hold"; do sleep 0.1; done
  if [ $# = 0 ] && [ "${NETTAP_KERNEL_MATRIX:-1}" != 0 ]; then
    # every host test beside the guests, not before them: a guest keeps ~0.85 of one of this
    # host's two CPUs busy, so two leave room. The unit tests two at a time (pytest-xdist;
    # no root, no kernel), then the kernel tests (~150 s, half of it waiting on sockets and
    # timers), then the e2e tests (real Prometheus, Alertmanager, NATS: mostly waiting on
    # them, ~0.3 of a CPU); their output follows the matrix's (each pytest's status is
    # written, not exited on: set -e holds in the subshell too)
    (t0=$(date +%s.%N)
     u=0; .venv/bin/python -m pytest -n 2 --junitxml="$out/host-unit.xml" tests/unit > "$out/host-unit.log" 2>&1 || u=$?
     echo $u > "$out/host-unit.rc"
     awk "BEGIN { print $(date +%s.%N) - $t0 }" > "$out/host-unit.took"
     k=0; .venv/bin/python -m pytest --junitxml="$out/host.xml" tests/kernel > "$out/host-kernel.log" 2>&1 || k=$?
     echo $k > "$out/host-kernel.rc"
     e=0; .venv/bin/python -m pytest --junitxml="$out/host-e2e.xml" tests/e2e > "$out/host-e2e.log" 2>&1 || e=$?
     echo $e > "$out/host-e2e.rc") & e2e=$!
  elif [ $# = 0 ]; then
    .venv/bin/python -m pytest -n 2 --junitxml="$out/host-unit.xml" tests/unit || rc=$?
    mark host-unit
    .venv/bin/python -m pytest --junitxml="$out/host.xml" tests/kernel || rc=$?
    .venv/bin/python -m pytest --junitxml="$out/host-e2e.xml" tests/e2e || rc=$?
    kill $hold 2>/dev/null || true
    mark host
  else
    .venv/bin/python -m pytest --junitxml="$out/host.xml" "$@" || rc=$?
    kill $hold 2>/dev/null || true
    mark host
  fi
fi
if [ "${NETTAP_KERNEL_MATRIX:-1}" != 0 ]; then
  # (it waits for the Go programs its guests run, not for the rest: tests/gobuild.py --kernel)
  if [ $host = 1 ]; then
    /usr/bin/python3 scripts/kernel_matrix.py --out "$out" --host-junit "$out/host.xml" || rc=1
  else
    /usr/bin/python3 scripts/kernel_matrix.py --out "$out" || rc=1
  fi
  mark matrix
fi
wait $gobuild || { echo "--- the Go test programs did not build:"; cat "$out/gobuild.log"; rc=1; }
if [ -n "${e2e:-}" ]; then
  wait $e2e || true
  kill $hold 2>/dev/null || true
  echo "--- host: the unit tests (they ran beside the guests)"
  cat "$out/host-unit.log"
  [ "$(cat "$out/host-unit.rc" 2>/dev/null)" = 0 ] || rc=1
  echo "--- host: the kernel tests (they ran beside the guests, after the unit tests)"
  cat "$out/host-kernel.log"
  [ "$(cat "$out/host-kernel.rc" 2>/dev/null)" = 0 ] || rc=1
  echo "--- host: the e2e tests (they ran beside the guests, after the kernel tests)"
  cat "$out/host-e2e.log"
  [ "$(cat "$out/host-e2e.rc" 2>/dev/null)" = 0 ] || rc=1
  mark e2e
fi
/usr/bin/python3 scripts/stages.py "$out" || true
exit $rc
