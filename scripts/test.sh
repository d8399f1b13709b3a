#!/usr/bin/env bash
# Run the tests (sets itself up first). By default the quick tier, every test not
# marked slow (about 4 minutes on 2 cores); with --full, every test (what CI runs,
# about 13 minutes a pass on lavapipe or llvmpipe with cold caches).
# Other arguments go to pytest (a -m of yours replaces the tier's).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
tier=(-m "not slow")
args=()
for arg in "$@"; do
    if [ "$arg" = --full ]; then tier=(); else args+=("$arg"); fi
done
exec .venv/bin/python -m pytest ${tier[@]+"${tier[@]}"} ${args[@]+"${args[@]}"}
