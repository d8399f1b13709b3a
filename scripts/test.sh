#!/usr/bin/env bash
# Run the tests (sets itself up first). By default the quick tier, every test not
# marked slow (3 min 56 s - 4 min 2 s on 2 cores with cold caches, 2026-12-08; a
# test over 10 s fails the run: tests/time_budget.py); with --full, every test (what CI runs).
# WORKERS pytest-xdist workers (default 2; 0: one process), each taking whole
# files (--dist loadfile: a file's module fixtures, Chromium and Node's package
# set up once). Without test paths, tests/test_endurance.py, which measures its
# own process's memory (disturbed by the tests a process ran before), runs alone
# after the others. Other arguments go to pytest (a -m of yours replaces the tier's).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
tier=(-m "not slow")
args=()
paths=0
for arg in "$@"; do
    if [ "$arg" = --full ]; then tier=(); else args+=("$arg"); fi
    case $arg in -*) ;; *) [ -e "${arg%%::*}" ] && paths=1 ;; esac
done
pytest=(.venv/bin/python -m pytest ${tier[@]+"${tier[@]}"})
xdist=(-n "${WORKERS:-2}" --dist loadfile)
# Several workers already fill the cores: each one's lavapipe runs its dispatches on one
# thread of its own rather than handing each to a pool as wide as the machine (2 workers
# on 2 cores: 10-19 % less time on six kernel-heavy files, 2026-12-08).
if [ "${WORKERS:-2}" -gt 1 ]; then export LP_NUM_THREADS=${LP_NUM_THREADS:-1}; fi
if [ "$paths" = 1 ]; then
    exec "${pytest[@]}" "${xdist[@]}" ${args[@]+"${args[@]}"}
fi
# pytest's exit status 5 (no test chosen) counts only where neither run chose one.
first=0 second=0
"${pytest[@]}" "${xdist[@]}" --ignore=tests/test_endurance.py ${args[@]+"${args[@]}"} || first=$?
"${pytest[@]}" tests/test_endurance.py ${args[@]+"${args[@]}"} || second=$?
if [ "$first" = 5 ] && [ "$second" = 5 ]; then exit 5; fi
[ "$first" = 5 ] && first=0
[ "$second" = 5 ] && second=0
exit $(( first ? first : second ))
