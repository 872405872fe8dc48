#!/bin/sh
# The README's first command: set up what running nettap needs, then run it
# (built-in default config unless flags say otherwise: scripts/run.sh --config FILE).
set -eu
cd "$(dirname "$0")/.."
scripts/setup.sh run
exec .venv/bin/nettap "$@"
