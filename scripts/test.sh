#!/usr/bin/env bash
# Run the whole test suite (sets itself up first). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec .venv/bin/python -m pytest "$@"
