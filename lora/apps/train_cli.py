"""``python -m lora train``: fine-tune LoRA adapters on scikit-learn's digits on the GPU.

The task, the frozen base network and the float64 reference are in
lora.apps.digits; the GPU training step in lora.apps.finetune. Prints a progress bar
with the loss, the test accuracy before and after, writes the adapter in
peft's format, a PNG of the loss curve and a JSON summary. ``--check`` runs
the same training in float64 numpy beside it and reports the largest
relative difference of the loss trajectory (exit status 1 above 1e-4).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from .command import dropout_problem, phase, progress

CHECK_RTOL = 1e-4


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lora train",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--batch", type=int, default=64, help="images per step (default 64)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0, help="scale = alpha / rank (default 16)")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default 1e-2)")
    p.add_argument("--schedule", choices=("constant", "linear", "cosine"), default="cosine")
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps (default 10)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    p.add_argument("--lora-dropout", type=float, default=0.0, metavar="P",
                   help="peft's lora_dropout on both adapters' inputs, in [0, 1), its masks "
                        "seeded by --seed (default 0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="lora-digits", help="output folder (default ./lora-digits)")
    p.add_argument("--check", action="store_true",
                   help="also train in float64 numpy and compare the loss trajectories")
    p.add_argument("--quick", action="store_true", help="30 steps (for CI)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (needs matplotlib)")
    return p


def optimizer_settings(lr: float, max_grad_norm: float | None, schedule: str, warmup: int,
                       steps: int) -> dict:
    """The digits fine-tuning's AdamW settings (also the web page's: lora.apps.web_train)."""
    return dict(lr=lr, max_grad_norm=max_grad_norm or None, schedule=schedule, warmup=warmup,
                total=steps, eps=1e-8, weight_decay=0.0)


def _optimizer_settings(args) -> dict:
    return optimizer_settings(args.lr, args.max_grad_norm, args.schedule, args.warmup,
                              args.steps)


def _train(args, data, base, device) -> dict:
    """Train on the GPU (and in float64 with --check); the losses and adapters."""
    from ..training.optim import AdamW
    from . import digits as D
    from .finetune import DigitsTrainer

    settings = _optimizer_settings(args)
    scale = args.alpha / args.rank
    start = D.init_adapters(args.rank, args.seed)
    trainer = DigitsTrainer(device, base, start, scale, args.batch, AdamW(**settings),
                            lora_dropout=args.lora_dropout, dropout_seed=args.seed)
    ref = {k: tuple(v.astype(np.float64) for v in p) for k, p in start.items()}
    state, gpu, cpu = {}, [], []
    began = time.perf_counter()
    for step, idx in enumerate(D.batches(len(data.train_y), args.batch, args.steps, args.seed), 1):
        x, y = data.train_x[idx], data.train_y[idx]
        trainer.load_batch(x, y)
        trainer.record()
        gpu.append(trainer.loss())
        if args.check:
            drop = D.dropout_multipliers(args.lora_dropout, args.seed, step, args.batch)
            cpu.append(D.reference_step(base, ref, scale, x, y, state, step, settings, drop))
        progress(step, args.steps, gpu[-1], began)
    return {"gpu": gpu, "cpu": cpu, "adapters": trainer.adapters(), "reference": ref,
            "seconds": time.perf_counter() - began}


def _plot(path: Path, gpu, cpu, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(gpu) + 1), gpu, label="GPU (float32)")
    if cpu:
        ax.plot(range(1, len(cpu) + 1), cpu, "--", label="numpy float64")
    ax.set(xlabel="step", ylabel="cross-entropy", yscale="log", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.quick:
        args.steps = 30
    for what in ("steps", "batch", "rank"):
        if getattr(args, what) < 1:
            print(f"error: --{what} must be >= 1", file=sys.stderr)
            return 2
    problem = dropout_problem(args.lora_dropout, args.seed)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    began = time.perf_counter()
    with phase("starting the GPU"):
        from shaderdsl.runtime import get_device
        device = get_device()
    with phase("loading scikit-learn's digits"):
        from ..training.adapter_io import save_adapter
        from . import digits as D
        data = D.load(args.seed)
    with phase(f"training the frozen base network in numpy ({D.BASE_STEPS} steps)"):
        base = D.train_base(data, args.seed)
    base = D.Base(*(v.astype(np.float32).astype(np.float64) for v in vars(base).values()))
    scale = args.alpha / args.rank
    before = D.accuracy(base, None, scale, data.test_x, data.test_y)
    print(f"digits: {len(data.train_y)} training and {len(data.test_y)} test images (8x8); base "
          f"network 64 -> {D.HIDDEN} -> 10 trained on the digits 0-4 only: test accuracy "
          f"{before:.1%}")
    dropout = f", dropout {args.lora_dropout:g}" if args.lora_dropout else ""
    print(f"LoRA rank {args.rank}, alpha {args.alpha:g}{dropout} on fc1 and fc2; "
          f"AdamW lr {args.lr:g} ({args.schedule}), {args.steps} steps of {args.batch} images "
          f"on {device.name} ({device.backend})")
    run = _train(args, data, base, device)
    after = D.accuracy(base, run["adapters"], scale, data.test_x, data.test_y)
    out = Path(args.out)
    save_adapter(out / "adapter", run["adapters"], alpha=args.alpha, target_modules=["fc1", "fc2"])
    summary = {"device": device.name, "backend": device.backend, "steps": args.steps,
               "lora_dropout": args.lora_dropout,
               "accuracy_before": before, "accuracy_after": after, "loss": run["gpu"],
               "seconds": run["seconds"]}
    print(f"test accuracy: {before:.1%} before, {after:.1%} after; loss {run['gpu'][0]:.4f} -> "
          f"{run['gpu'][-1]:.4f}; the LoRA training took {run['seconds']:.1f} s"
          f"{' (with the float64 check)' if args.check else ''}")
    status = 0
    if args.check:
        diff = float(np.max(np.abs(np.array(run["gpu"]) - run["cpu"]) / np.abs(run["cpu"])))
        summary.update(reference_loss=run["cpu"], max_relative_difference=diff)
        ok = diff <= CHECK_RTOL
        print(f"check: the GPU loss trajectory is within {diff:.2e} (relative) of float64 numpy "
              f"over {args.steps} steps: {'ok' if ok else f'FAIL (> {CHECK_RTOL:g})'}")
        status = 0 if ok else 1
    if not args.no_plot:
        _plot(out / "loss.png", run["gpu"], run["cpu"],
              f"LoRA fine-tuning on digits ({device.name})")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot = "" if args.no_plot else f", {out / 'loss.png'}"
    print(f"wrote {out / 'adapter'} (peft format){plot}, {out / 'summary.json'}")
    print(f"wall time {time.perf_counter() - began:.1f} s in all (the Python start and imports "
          f"before this command's first line excluded)")
    return status


if __name__ == "__main__":
    sys.exit(main())
