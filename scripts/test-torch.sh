#!/usr/bin/env bash
# The tests that compare with PyTorch and peft (elsewhere they skip, saying why): in a
# virtual environment of their own, .venv-torch, since torch's Linux wheels bring CUDA
# (about 4 GB to download) and the test extras leave torch out. CPU is enough. Sets itself
# up as test.sh does; arguments go to pytest. About a minute once installed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
if [ ! -x .venv-torch/bin/python ]; then
    echo "[test-torch] creating .venv-torch"
    python3 -m venv .venv-torch
fi
stamp=.venv-torch/.installed-$(cat pyproject.toml | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
    echo "[test-torch] installing shaderdsl with its test and train extras, torch and peft"
    .venv-torch/bin/python -m pip install -q -e ".[test,train]" torch peft
    touch "$stamp"
fi
exec .venv-torch/bin/python -m pytest -m "not slow" -rs tests/test_adapter_peft.py \
    tests/test_network.py tests/test_many.py tests/test_torch_inputs.py \
    tests/test_doc_blocks.py tests/test_lm_load.py tests/test_finetune_lm.py "$@"
