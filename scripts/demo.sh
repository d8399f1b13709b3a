#!/usr/bin/env bash
# Run the LoRA demo on the default adapter (sets itself up first).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec .venv/bin/python -m lora demo "$@"
