"""``python -m lora finetune-lm``: fine-tune LoRA adapters of a causal LM folder on a text file.

    python -m lora finetune-lm --model SmolLM2-135M --text notes.txt --steps 200 --out run/

The folder is a local Hugging Face model (config.json and safetensors; lora.CausalLM
runs Llama and Qwen2); the text is tokenized with its tokenizer.json, or read as
bytes where it has none (lora.apps.lm_text), packed into sequences of --seq tokens,
the last --held-out part kept for evaluation. Prints what the text gave, the loss as
it falls, the held-out loss and a greedy sample before and after training; writes
the adapter in peft's format, a PNG of the loss curve and a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from .command import dropout_problem, phase, progress

QUICK_STEPS, QUICK_NEW_TOKENS = 20, 16
PROMPT_TOKENS = 16   # the default prompt: the held-out text's first tokens
DTYPES = {"f32": np.float32, "f16": np.float16}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lora finetune-lm",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("--model", required=True, metavar="FOLDER",
                   help="a local Hugging Face model folder (config.json, safetensors, "
                        "tokenizer.json if any)")
    p.add_argument("--text", required=True, metavar="FILE", help="the text to train on")
    p.add_argument("--out", default="lora-lm", help="output folder (default ./lora-lm)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="training steps (default 100)")
    length.add_argument("--epochs", type=float, help="passes over the training sequences")
    p.add_argument("--held-out", type=float, default=0.1, metavar="FRACTION",
                   help="the text's last part kept for evaluation (default 0.1)")
    p.add_argument("--eval-batches", type=int, default=8,
                   help="held-out batches the evaluation loss averages (default 8)")
    p.add_argument("--target-modules", default="q_proj,v_proj",
                   help="comma-separated module names, or all-linear (default q_proj,v_proj)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0, help="scale = alpha / rank (default 16)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--schedule", choices=("constant", "linear", "cosine"), default="cosine")
    p.add_argument("--warmup", type=int, help="warm-up steps (default a tenth of the steps)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="f32",
                   help="f16: mixed precision as torch.autocast (needs shader-f16)")
    p.add_argument("--lora-dropout", type=float, default=0.0, metavar="P",
                   help="peft's lora_dropout, in [0, 1) (default 0: none)")
    p.add_argument("--seed", type=int, default=0, help="seeds A, the batches and dropout")
    p.add_argument("--prompt", help="the samples' prompt (default: the held-out text's first "
                                    f"{PROMPT_TOKENS} tokens)")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="greedy tokens per sample (default 32; 0: no samples)")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_STEPS} steps (unless --steps or --epochs), one evaluation "
                        f"batch, at most {QUICK_NEW_TOKENS} new tokens (for CI)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (needs matplotlib)")
    return p


def _argument_problem(args) -> str:
    """What is wrong with the arguments that needs no file read, or ""."""
    for what, low in (("seq", 2), ("batch", 1), ("steps", 1), ("rank", 1), ("eval_batches", 1),
                      ("max_new_tokens", 0), ("warmup", 0)):
        value = getattr(args, what)
        if value is not None and value < low:
            return f"--{what.replace('_', '-')} must be >= {low}, got {value}"
    if args.epochs is not None and not 0 < args.epochs < math.inf:
        return f"--epochs must be a number > 0, got {args.epochs:g}"
    if not 0 < args.held_out < 1:  # (NaN too)
        return f"--held-out must be a fraction in (0, 1), got {args.held_out:g}"
    if not 0 <= args.seed < 2**32:
        return f"--seed must be in [0, 2^32), got {args.seed}"
    if not 0 < args.alpha < math.inf:
        return f"--alpha must be a number > 0, got {args.alpha:g}"
    if not Path(args.text).is_file():
        return f"--text {args.text}: no such file"
    if not _targets(args.target_modules):
        return "--target-modules names no module: give names such as q_proj,v_proj, or all-linear"
    return dropout_problem(args.lora_dropout, args.seed)


def _targets(text: str):
    """--target-modules as peft's target_modules: "all-linear", or a list of names."""
    if text.strip() == "all-linear":
        return "all-linear"
    return [name.strip() for name in text.split(",") if name.strip()]


def _optimizer(args, steps: int):
    """The AdamW of these arguments (ValueError naming a bad setting)."""
    from ..training.optim import AdamW
    from .train_cli import optimizer_settings

    warmup = steps // 10 if args.warmup is None else args.warmup
    return AdamW(**optimizer_settings(args.lr, args.max_grad_norm, args.schedule, warmup,
                                      steps))


def _steps(args, sequences: int) -> int:
    """--steps, or the steps --epochs makes of this many sequences (default 100,
    or 20 with --quick)."""
    if args.steps is not None:
        return args.steps
    if args.epochs is not None:
        return max(1, math.ceil(args.epochs * sequences / args.batch))
    return QUICK_STEPS if args.quick else 100


def _describe_model(folder: Path, config) -> str:
    from ..models.config import weight_shapes

    params = sum(math.prod(shape) for shape in weight_shapes(config).values())
    c = config
    head = "tied to the embedding" if c.tie_word_embeddings else "untied"
    return (f"model: {folder} ({c.architecture}): {c.num_hidden_layers} layers, hidden "
            f"{c.hidden_size}, {c.num_attention_heads} heads ({c.num_key_value_heads} kv), "
            f"vocab {c.vocab_size}, {params / 1e6:.2f} M parameters, head {head}")


def _describe_text(path: Path, codec, packed, batch: int, eval_rows: int) -> str:
    seq = packed.train.shape[1]
    how = "as bytes (the folder has no tokenizer.json)" if codec.is_bytes else \
        f"with {codec.source}"
    return (f"text: {path} ({path.stat().st_size} bytes) tokenized {how}: {packed.tokens} "
            f"tokens; {packed.train_tokens} for training make {len(packed.train)} sequences of "
            f"{seq}, the last {packed.tokens - packed.train_tokens} held out make "
            f"{len(packed.held_out)} ({eval_rows} evaluated, in batches of {batch})")


def shifted_cross_entropy(logits: np.ndarray, ids: np.ndarray) -> tuple[float, int]:
    """The summed cross-entropy of each next token under ``logits`` [rows, seq,
    vocab], in float64, and how many tokens it sums: transformers' shifted loss
    (position t predicts ids[t + 1]) times its count."""
    total = 0.0
    for row, target in zip(logits, ids):
        x = row[:-1].astype(np.float64)
        top = x.max(axis=1)
        log_sum = top + np.log(np.exp(x - top[:, None]).sum(axis=1))
        total += float((log_sum - x[np.arange(len(x)), target[1:]]).sum())
    return total, ids.shape[0] * (ids.shape[1] - 1)


def held_out_loss(lm, sequences: np.ndarray, batch: int) -> float:
    """The mean next-token cross-entropy over ``sequences`` (lm.logits in batches of
    ``batch``, a short last batch filled with copies so one shape serves)."""
    total, count = 0.0, 0
    for start in range(0, len(sequences), batch):
        rows = sequences[start:start + batch]
        filled = np.concatenate([rows, np.repeat(rows[-1:], batch - len(rows), axis=0)])
        part, n = shifted_cross_entropy(lm.logits(filled)[:len(rows)], rows)
        total, count = total + part, count + n
    return total / count


def _sample(lm, codec, prompt: np.ndarray, new_tokens: int) -> str:
    """The greedy continuation of ``prompt``, decoded; it ends early at the
    config's eos ids with a tokenizer (bytes have none: eos_token_id=())."""
    out = lm.generate(prompt[None, :], new_tokens, eos_token_id=() if codec.is_bytes else None)
    return codec.decode(out[0, len(prompt):])


def _train(lm, packed, args, steps: int) -> tuple[list[float], float]:
    """``steps`` steps over the training sequences; each step's loss and the seconds."""
    from .lm_text import batches

    losses: list[float] = []
    began = time.perf_counter()
    for step, rows in enumerate(batches(len(packed.train), args.batch, steps, args.seed), 1):
        lm.step(packed.train[rows])
        losses.append(lm.loss())
        progress(step, steps, losses[-1], began)
    return losses, time.perf_counter() - began


def _plot(path: Path, losses: list[float], held_out: tuple[float, float], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), losses, label="training batch")
    ax.plot([0, len(losses)], held_out, "o--", label="held-out text")
    ax.set(xlabel="step", ylabel="cross-entropy (nats per token)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class Refused(Exception):
    """Input the command cannot run on; main reports it as an argument error."""


def _read_inputs(args):
    """The weights (read lazily), the codec, the packed text and the prompt, all
    checked before the GPU starts; Refused naming what is wrong."""
    from ..models.checks import ModelError
    from ..models.weights import load_weights
    from .lm_text import TextError, pack, text_codec

    folder, text = Path(args.model), Path(args.text)
    try:
        with phase("reading the model folder"):
            weights = load_weights(folder, DTYPES[args.dtype])
        config = weights.config
        print(_describe_model(folder, config))
        limit = config.max_position_embeddings
        if args.seq > limit:
            raise Refused(f"--seq {args.seq} is past the model's max_position_embeddings "
                          f"{limit}")
        with phase(f"tokenizing {text}"):
            codec = text_codec(folder, config.vocab_size)
            packed = pack(codec.encode_file(text), args.seq, args.held_out)
        prompt = codec.encode(args.prompt) if args.prompt is not None else \
            packed.held_out[0, :min(PROMPT_TOKENS, args.seq)]
    except (ModelError, TextError) as e:
        raise Refused(str(e)) from None
    if not len(prompt):
        raise Refused(f"--prompt {args.prompt!r} gives no tokens")
    if len(prompt) + args.max_new_tokens > limit:
        raise Refused(f"the prompt's {len(prompt)} tokens and --max-new-tokens "
                      f"{args.max_new_tokens} pass the model's max_position_embeddings {limit}")
    return weights, codec, packed, prompt


def _make_model(args, weights, steps: int):
    """The GPU's CausalLM with fresh adapters on --target-modules (Refused for a
    setting it does not take: an optimizer's, targets, f16 without shader-f16)."""
    from shaderdsl.errors import FeatureError
    from shaderdsl.runtime import get_device

    from ..models.causal_lm import CausalLM
    from ..models.checks import ModelError
    from ..models.targets import lm_modules, resolve_targets

    try:
        optimizer = _optimizer(args, steps)
        targets = _targets(args.target_modules)
        resolve_targets(targets, lm_modules(weights.config))  # before the GPU starts
    except ValueError as e:  # ModelError too
        raise Refused(str(e)) from None
    with phase("starting the GPU"):
        device = get_device()
    try:
        with phase(f"loading the model onto {device.name} ({device.backend})"):
            return CausalLM(weights, target_modules=targets, rank=args.rank, alpha=args.alpha,
                            dtype=DTYPES[args.dtype], optimizer=optimizer, seed=args.seed,
                            lora_dropout=args.lora_dropout, dropout_seed=args.seed,
                            device=device)
    except (ModelError, ValueError, FeatureError) as e:
        raise Refused(str(e)) from None


def _describe_training(args, lm, packed, steps: int) -> str:
    adapters = lm.adapters()
    short = sorted({name.rsplit(".", 1)[-1] for name in adapters})
    params = sum(a.size + b.size for a, b in adapters.values())
    settings = lm.optimizer.settings
    dropout = f", dropout {args.lora_dropout:g}" if args.lora_dropout else ""
    epochs = steps * args.batch / len(packed.train)
    return (f"LoRA rank {args.rank}, alpha {args.alpha:g}{dropout} on {len(adapters)} modules "
            f"({', '.join(short)}): {params} trainable parameters, the base frozen; AdamW lr "
            f"{args.lr:g} ({args.schedule}, {int(settings['warmup'])} warm-up steps); {steps} "
            f"steps of {args.batch} x {args.seq} tokens ({epochs:.2f} epochs), {args.dtype}")


def _samples(lm, codec, prompt, args, when: str) -> str | None:
    """A greedy sample of --max-new-tokens after ``prompt``, printed (None with 0)."""
    if not args.max_new_tokens:
        return None
    with phase(f"greedy sample {when} training ({args.max_new_tokens} new tokens)"):
        text = _sample(lm, codec, prompt, args.max_new_tokens)
    print(f"  {when}: {text!r}")
    return text


def _size(nbytes: int) -> str:
    """Bytes as a reader takes them in: 512 B, 3.4 KiB, 270.1 MiB, 1.2 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _evaluate(lm, rows: np.ndarray, batch: int, when: str) -> float:
    with phase(f"held-out loss {when} training ({len(rows)} sequences)"):
        loss = held_out_loss(lm, rows, batch)
    print(f"  {when}: {loss:.4f} (perplexity {math.exp(loss):.1f})")
    return loss


def _write(args, lm, out: Path, summary: dict) -> None:
    """The adapter (peft's format), the loss curve unless --no-plot, the summary."""
    out.mkdir(parents=True, exist_ok=True)
    lm.save_adapter(out / "adapter", base_model_name_or_path=summary["model"])
    if not args.no_plot:
        _plot(out / "loss.png", summary["loss"], (summary["held_out_loss_before"],
                                                   summary["held_out_loss_after"]),
              f"LoRA fine-tuning of {Path(args.model).name} on {Path(args.text).name}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot = "" if args.no_plot else f", the loss curve {out / 'loss.png'}"
    print(f"wrote the adapter {out / 'adapter'} (peft's format, base_model_name_or_path "
          f"{summary['model']}){plot} and {out / 'summary.json'}")


def _run(args):
    """Everything after the arguments: the trained model and the run's summary."""
    weights, codec, packed, prompt = _read_inputs(args)
    eval_rows = packed.held_out[:(1 if args.quick else args.eval_batches) * args.batch]
    print(_describe_text(Path(args.text), codec, packed, args.batch, len(eval_rows)))
    steps = _steps(args, len(packed.train))
    lm = _make_model(args, weights, steps)
    print(_describe_training(args, lm, packed, steps))
    loss_before = _evaluate(lm, eval_rows, args.batch, "before")
    if args.max_new_tokens:
        print(f"  prompt: {codec.decode(prompt)!r}")
    sample_before = _samples(lm, codec, prompt, args, "before")
    print("training ...")
    losses, seconds = _train(lm, packed, args, steps)
    print(f"training loss {losses[0]:.4f} -> {losses[-1]:.4f} in {seconds:.1f} s "
          f"({steps * args.batch * args.seq / seconds:.0f} tokens/s)")
    memory = lm.memory()
    print(f"GPU memory: {', '.join(f'{part} {_size(n)}' for part, n in memory.items())}; "
          f"{_size(sum(memory.values()))} in all")
    loss_after = _evaluate(lm, eval_rows, args.batch, "after")
    sample_after = _samples(lm, codec, prompt, args, "after")
    device = lm.device
    return lm, {"model": str(Path(args.model).resolve()), "text": str(Path(args.text).resolve()),
            "tokenizer": codec.source, "tokens": packed.tokens,
            "train_sequences": len(packed.train), "held_out_sequences": len(packed.held_out),
            "evaluated_sequences": len(eval_rows), "seq": args.seq, "batch": args.batch,
            "steps": steps, "target_modules": sorted(lm.adapters()), "rank": args.rank,
            "alpha": args.alpha, "lr": args.lr, "schedule": args.schedule,
            "warmup": int(lm.optimizer.settings["warmup"]), "max_grad_norm": args.max_grad_norm,
            "dtype": args.dtype, "lora_dropout": args.lora_dropout, "seed": args.seed,
            "device": device.name, "backend": device.backend, "loss": losses,
            "train_seconds": seconds, "memory": memory, "held_out_loss_before": loss_before,
            "held_out_loss_after": loss_after, "prompt": codec.decode(prompt),
            "sample_before": sample_before, "sample_after": sample_after}


def run(argv=None):
    """The command: (the trained lora.CausalLM, the summary written); SystemExit
    (status 2, argparse's message) for input it cannot run on."""
    p = parser()
    args = p.parse_args(argv)
    if args.quick:
        args.max_new_tokens = min(args.max_new_tokens, QUICK_NEW_TOKENS)
    problem = _argument_problem(args)
    if problem:
        p.error(problem)
    began = time.perf_counter()
    try:
        lm, summary = _run(args)
    except Refused as e:
        p.error(str(e))
    _write(args, lm, Path(args.out), summary)
    print(f"wall time {time.perf_counter() - began:.1f} s in all (the Python start and imports "
          f"before this command's first line excluded)")
    return lm, summary


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
