#!/bin/sh
# The README's second command (and CI's): set up what testing needs, then check
# the committed BPF objects and rendered mixin are fresh and run every test.
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not kernel and not e2e".
set -eu
cd "$(dirname "$0")/.."
scripts/setup.sh test
make -s -C bpf check
.venv/bin/python alerts/render.py --check
exec .venv/bin/python -m pytest "$@"
