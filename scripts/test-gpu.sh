#!/usr/bin/env bash
# The whole suite on a real GPU under one wgpu build: `scripts/test-gpu.sh native`
# or `scripts/test-gpu.sh dawn` (SHADERDSL_WGPU=dawn). No set-up: it runs the
# python3 it finds, which must already have numpy, wgpu (and wgpudawn),
# hypothesis, pytest and pytest-xdist (the H200 machine reaches no registry; see
# README "Tests on a real GPU"). Runs WORKERS (default 14) pytest-xdist workers;
# the report goes to stdout and to ${OUT:-.}/pytest-<build>.txt.
# Other arguments go to pytest.
set -euo pipefail
build=${1:?"usage: scripts/test-gpu.sh native|dawn [pytest arguments]"}
shift
case $build in
    native) export SHADERDSL_WGPU=native ;;
    dawn) export SHADERDSL_WGPU=dawn ;;
    *) echo "scripts/test-gpu.sh: the build is native or dawn, not '$build'" >&2; exit 2 ;;
esac
report=${OUT:-.}/pytest-$build.txt
# The default tier's 10 s a test (tests/time_budget.py) is lavapipe's budget on 2 cores, not
# this machine's: off here unless asked for.
export SHADERDSL_TEST_BUDGET=${SHADERDSL_TEST_BUDGET:-0}
# tests/test_endurance.py measures its own process's RSS, which the other tests of an
# xdist worker disturb (30 MiB of growth on the H200 there, none alone): it runs alone, after
status=0
python3 -m pytest tests -q -p no:cacheprovider -n "${WORKERS:-14}" -rfEX \
    --ignore=tests/test_endurance.py "$@" 2>&1 | tee "$report" || status=1
python3 -m pytest tests/test_endurance.py -q -p no:cacheprovider -rfEX "$@" 2>&1 \
    | tee -a "$report" || status=1
exit $status
