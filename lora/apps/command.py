"""What the training commands (``python -m lora train``, ``finetune-lm``) share: the
progress bar with the loss as it falls, phases announced with their time, and the
check of ``--lora-dropout``."""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager


def progress(step: int, total: int, loss: float, started: float) -> None:
    """One line of the progress bar: redrawn in place on a terminal, ten lines in a log."""
    width = 30
    done = width * step // total
    line = (f"\r[{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.4f}  "
            f"{time.perf_counter() - started:.1f} s")
    if sys.stdout.isatty():
        print(line, end="" if step < total else "\n", flush=True)
    elif step == total or step % max(1, total // 10) == 0:
        print(line.lstrip("\r"), flush=True)


@contextmanager
def phase(what: str):
    """Say what is starting, then how long it took: no silent second."""
    print(f"{what} ...", end="", flush=True)
    t0 = time.perf_counter()
    try:
        yield
    except BaseException:
        print(" failed", flush=True)  # the line ends before the error is told
        raise
    print(f" {time.perf_counter() - t0:.1f} s", flush=True)


def dropout_problem(p: float, seed: int) -> str:
    """What is wrong with --lora-dropout (and --seed, which seeds its masks), or ""."""
    if not 0.0 <= p < 1.0:  # (NaN too)
        return f"--lora-dropout must be in [0, 1) (a probability), got {p:g}"
    if p and not 0 <= seed < 2**32:
        return f"--seed must be in [0, 2^32) to seed --lora-dropout's masks, got {seed}"
    return ""
