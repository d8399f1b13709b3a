#!/usr/bin/env bash
# The lint and type gate (sets itself up first; CI runs it before the tests):
# ruff (pyflakes, pycodestyle, import order; 100 columns) and pyright (basic) on
# shaderdsl/, lora/, tests/ and examples/, as pyproject.toml configures them, and
# `node --check` on the JavaScript the package ships; no tracked file over 256 kB
# and no wheel or shared library (pre-commit-hooks' check-added-large-files).
# Arguments go to ruff check (e.g. --fix).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
status=0
echo "[lint] ruff check"
.venv/bin/ruff check "$@" || status=1
echo "[lint] pyright"
.venv/bin/pyright || status=1
js=$(git ls-files 'shaderdsl/*.js' 'lora/*.js' 'shaderdsl/*.mjs' 'lora/*.mjs')
if [ -n "$js" ]; then
    echo "[lint] node --check on $(echo "$js" | wc -l) JavaScript files"
    if command -v node >/dev/null; then
        for f in $js; do node --check "$f" || status=1; done
    else
        echo "[lint] no node on PATH: the JavaScript is not checked" >&2; status=1
    fi
fi
echo "[lint] no tracked file over 256 kB, no packaged binary"
.venv/bin/check-added-large-files --enforce-all --maxkb=256 $(git ls-files) || status=1
binaries=$(git ls-files '*.whl' '*.so' '*.dll' '*.dylib' '*.tar.gz' '*.zip' '*.egg')
if [ -n "$binaries" ]; then echo "[lint] packaged binaries are tracked: $binaries" >&2; status=1; fi
exit $status
