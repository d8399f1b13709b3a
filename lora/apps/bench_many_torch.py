"""The CUDA baselines of ``python -m lora bench --many`` (lora.apps.bench_many):
a batch whose rows each name one of several LoRA adapters, on PyTorch in the
same process, each captured in a CUDA graph and timed with CUDA events.

- **loop**: what a peft user writes (and what peft's ``adapter_names`` does
  inside): for each adapter, gather its rows, multiply, ``index_add_`` back.
- **padded**: vLLM's layout: the adapters stacked and padded to the largest
  rank; decode gathers each row's padded A and B and runs two ``bmm`` (BGMV-
  like), prefill runs its equal segments as two ``bmm`` (SGMV-like).
"""
from __future__ import annotations

import numpy as np

from .bench_train import _captured, _cuda_us, optional_torch


def torch_many_us(case: dict) -> dict:
    """{"loop_us", "padded_us"} for ``case`` (bench_many.make_case's), or
    {"why": ...} where PyTorch or CUDA is missing."""
    torch = optional_torch()
    if torch is None:
        return {"why": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"why": f"torch {torch.__version__} without CUDA"}
    dt = torch.float16 if case["dtype"] == "f16" else torch.float32

    def cuda(v):
        return torch.from_numpy(np.ascontiguousarray(v)).to("cuda", dt)

    x, out = cuda(case["x"]), cuda(case["base"])
    ids = torch.from_numpy(case["ids"]).to("cuda", torch.int64)
    adapters = [(cuda(a), cuda(b), s) for a, b, s in case["adapters"]]
    return {"loop_us": _graph_us(torch, _loop(torch, x, out, ids, adapters)),
            "padded_us": _graph_us(torch, _padded(torch, x, out, ids, adapters, case))}


def _graph_us(torch, step) -> float:
    graph = _captured(torch, step)
    return _cuda_us(torch, lambda: [graph.replay() for _ in range(20)], 20)


def _loop(torch, x, out, ids, adapters):
    rows = [torch.nonzero(ids == i).flatten() for i in range(len(adapters))]

    def step():
        for (a, b, s), r in zip(adapters, rows):
            if len(r):
                out.index_add_(0, r, (x[r] @ a.T) @ b.T, alpha=s)
    return step


def _padded(torch, x, out, ids, adapters, case):
    rank = max(a.shape[0] for a, _, _ in adapters)
    n, in_dim, out_dim = len(adapters), x.shape[1], out.shape[1]
    A = torch.zeros(n, rank, in_dim, device="cuda", dtype=x.dtype)
    Bt = torch.zeros(n, rank, out_dim, device="cuda", dtype=x.dtype)
    for i, (a, b, s) in enumerate(adapters):
        A[i, :a.shape[0]] = a
        Bt[i, :a.shape[0]] = (s * b).T
    if case["kind"] == "decode":
        def step():
            h = torch.bmm(A[ids], x.unsqueeze(2))                      # [rows, rank, 1]
            out.add_(torch.bmm(Bt[ids].transpose(1, 2), h).squeeze(2))
        return step
    seg = x.shape[0] // n  # prefill: equal segments, one per adapter, in order

    def step():
        xs = x.view(n, seg, in_dim)
        h = torch.bmm(xs, A.transpose(1, 2))                            # [n, seg, rank]
        out.view(n, seg, out_dim).add_(torch.bmm(h, Bt))
    return step
