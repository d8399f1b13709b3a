"""``python -m lora bench --lm``: a transformer language model with LoRA on every Linear
(rank 16, "all-linear"), ours (lora.CausalLM, lora.apps.bench_lm_ours) beside
transformers + peft in the same process (lora.apps.bench_lm_torch), on random weights
in the shapes of SmolLM2-135M (Llama) and Qwen2.5-0.5B (Qwen2, q/k/v biases), both tied.

Rows, for each model:

- **train f16 / train f32**: one training step on 8 x 512 tokens (labels = the ids),
  AdamW on every adapter. Ours: f16 mixed precision (or f32), each step its own
  submit, wall time over 5 steps ended by reading the loss (``ms``), and the GPU time
  by timestamps (``GPU ms``). Theirs: the fp16 model under fp16 autocast with float32
  adapters (or all f32), no GradScaler, eager with SDPA attention, and (f16) the same
  model by ``torch.compile``; CUDA events.
- **prefill bB**: ``generate(prompt, max_new_tokens=1)`` on B prompts of 128 tokens,
  wall time: prompt tokens per second. GPU ms and the shares: generate's prefill graph.
- **decode bB**: ``generate(prompt, 128)`` less the prefill, over the 127 later tokens:
  new tokens per second, both greedy with a KV cache on the GPU (theirs: transformers'
  eager ``generate(do_sample=False)``, peft's adapters unmerged as ours, and the same
  with the adapters disabled: transformers alone). GPU ms and the shares: one of
  generate's decode steps. No end-of-sequence id: every token asked for is made.

Each row: medians of several repetitions after a warm-up, ours' tokens per second over
theirs (``x``: above 1, ours is faster), the shares of our GPU time in the frozen base
products (``dense*`` kernels), attention (``attention*``) and the rest
(lora.apps.bench_lm_ours says how they are timed), and memory: lm.memory() (decode:
and a generate's graphs and KV cache), torch's ``max_memory_allocated``. Every section
runs under a time limit and in a try: a failure is reported in the row and the run goes
on. ``--quick``: tiny models (torch on the CPU where there is no CUDA), for CI. Writes
``lm-<compiler>.json`` to ``--out`` after each row.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import re
import signal
import statistics
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from shaderdsl.runtime import COMPILER, WGPU_BUILD, get_device

from . import bench_lm_ours as ours_side
from . import bench_lm_torch as torch_side
from .bench_ceiling import copy_bandwidth

MODELS = {
    "SmolLM2-135M": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                         max_position_embeddings=8192, rms_norm_eps=1e-5),
    "Qwen2.5-0.5B": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                         max_position_embeddings=32768, rms_norm_eps=1e-6),
}
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
PARTS = ("train", "generate")
DTYPES = {"f16": np.float16, "f32": np.float32}


@dataclass(frozen=True)
class Settings:
    """The sizes and counts of a run: the training batch, LoRA's rank, the batches,
    prompt and new tokens of generation, steps per timed repetition and repetitions
    (``gen_repeats``: of each generate call), and each section's time limit."""

    train_batch: int = 8
    train_seq: int = 512
    rank: int = 16
    gen_batches: tuple = (1, 8)
    prompt: int = 128
    new_tokens: int = 128
    steps: int = 5
    repeats: int = 5
    gen_repeats: int = 3
    timeout_s: float = 300.0


FULL = Settings()
QUICK = Settings(train_batch=2, train_seq=16, gen_batches=(1, 2), prompt=8, new_tokens=4,
                 steps=2, repeats=2, gen_repeats=2, timeout_s=120.0)


# no end-of-sequence id: both sides generate every token asked for (random weights would
# stop at random places)
NO_END = dict(bos_token_id=None, eos_token_id=None)


def model_config(name: str, quick: bool) -> dict:
    """The config.json dict of ``name``'s shapes (``quick``: TINY's sizes)."""
    return {**MODELS[name], **(TINY if quick else {}), **NO_END}


class SectionTimeout(Exception):
    """A section ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise SectionTimeout in the block after ``seconds`` (SIGALRM: the main thread
    of a Unix process; elsewhere no limit). A native call finishes first."""
    if not seconds or not hasattr(signal, "setitimer") or \
            threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise SectionTimeout(f"over its {seconds:g} s limit")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def error_text(e: BaseException) -> str:
    """A failure as one line: its type and its message's first line (200 characters)."""
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return f"{type(e).__name__}: {first}"


def generate_times(generate, prompt: np.ndarray, new_tokens: int, repeats: int) -> dict:
    """Median wall seconds of ``generate(prompt, 1)`` (``t1_s``) and of
    ``generate(prompt, new_tokens)`` (``tn_s``) after one untimed call of each, and
    the new tokens of the last call; ValueError where its shape is not [batch,
    prompt + new_tokens]."""
    generate(prompt, 1)
    out = generate(prompt, new_tokens)
    want = (prompt.shape[0], prompt.shape[1] + new_tokens)
    if out.shape != want:
        raise ValueError(f"generate returned ids of shape {list(out.shape)}, expected "
                         f"{list(want)}")

    def median_s(n: int) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            generate(prompt, n)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    return {"t1_s": median_s(1), "tn_s": median_s(new_tokens), "new": out[:, prompt.shape[1]:]}


def rates(batch: int, prompt: int, new_tokens: int, t1_s: float, tn_s: float) -> dict:
    """Prefill (generate with 1 new token) and decode (the later new tokens) in
    milliseconds (decode: per step of ``batch`` tokens) and tokens per second."""
    later = tn_s - t1_s
    decode = later > 0 and new_tokens > 1
    return {"prefill_ms": t1_s * 1e3, "prefill_tok_s": batch * prompt / t1_s,
            "decode_ms": later / (new_tokens - 1) * 1e3 if decode else float("nan"),
            "decode_tok_s": batch * (new_tokens - 1) / later if decode else float("nan")}


def ratios(row: dict) -> None:
    """``vs_<theirs>``: ours' tokens per second over theirs (above 1: ours is faster)."""
    for theirs in ("torch", "torch_compiled", "torch_no_lora"):
        if "ours_tok_s" in row and f"{theirs}_tok_s" in row:
            row[f"vs_{theirs}"] = row["ours_tok_s"] / row[f"{theirs}_tok_s"]


def token_ids(batch: int, seq: int, vocab: int, seed: int = 0) -> np.ndarray:
    """Random ids [batch, seq], int64, away from the special ids 0-2."""
    return np.random.default_rng(seed).integers(3, vocab, (batch, seq)).astype(np.int64)


@dataclass
class Side:
    """One side of a row: its model, or why there is none (``failed``: an error, else
    something not installed or not supported here)."""

    model: Any = None
    why: str | None = None
    failed: bool = False


class Run:
    """One run: the device, torch's modules (or why there are none), the settings,
    the rows measured so far, and ``save`` (called with the rows after each)."""

    def __init__(self, device, settings: Settings, quick: bool, log, save):
        self.device, self.settings, self.quick, self.log, self.save = \
            device, settings, quick, log, save
        self.rows: list[dict] = []
        self.mods = torch_side.modules()
        self.torch_device, self.torch_why = "", None
        if isinstance(self.mods, str):
            self.torch_why = self.mods
        else:
            try:
                self.torch_device = torch_side.device_for(self.mods, quick)
            except ValueError as e:
                self.torch_why = str(e)

    def attempt(self, fn) -> tuple:
        """(fn(), None), or (None, what it raised) where it raised or ran too long."""
        try:
            with time_limit(self.settings.timeout_s):
                return fn(), None
        except Exception as e:  # any failure: the row says it, the run goes on
            return None, error_text(e)

    def section(self, row: dict, key: str, fn):
        """fn()'s value, or None with the failure in ``row["errors"][key]``."""
        value, why = self.attempt(fn)
        if why is not None:
            row["errors"][key] = why
            self.log(f"  {row['model']} {row['row']}: {key} failed: {why}")
        return value

    def add(self, row: dict) -> None:
        ratios(row)
        self.rows.append(row)
        self.log(row_line(row))
        self.save(self.rows)

    # ------------------------------------------------------------ models

    def model(self, name: str, parts) -> None:
        """Every row of ``parts`` for the model ``name``: each dtype's training step,
        then generation (f16), each on fresh models (B = 0 on both sides)."""
        config = model_config(name, self.quick)
        base, why = None, self.torch_why
        if why is None:
            base, failed = self.attempt(lambda: torch_side.base_model(
                self.mods, config, self.torch_device))
            why = None if failed is None else f"transformers' model not built: {failed}"
        cases = [(f"train {d}", d) for d in DTYPES if "train" in parts]
        cases += [("generate", "f16")] if "generate" in parts else []
        for what, dtype in cases:
            ours = self._ours(config, base, dtype)
            theirs = self._theirs(base, why, dtype)
            if what == "generate":
                for row in self.generate_rows(name, config, ours, theirs):
                    self.add(row)
            else:
                self.add(self.train_row(name, dtype, config, ours, theirs))
            del ours, theirs
            gc.collect()
            if self.torch_why is None:
                torch_side.release(self.mods, self.torch_device)

    def _ours(self, config: dict, base, dtype: str) -> Side:
        if dtype == "f16" and not self.device.has_feature("shader-f16"):
            return Side(why=f"{self.device.name} lacks shader-f16")
        s = self.settings
        lm, why = self.attempt(lambda: ours_side.build(config, base, DTYPES[dtype], s.rank,
                                                       self.device))
        return Side(lm, None if why is None else f"not built: {why}", why is not None)

    def _theirs(self, base, why: str | None, dtype: str) -> Side:
        if base is None:
            return Side(why=why, failed=self.torch_why is None)
        model, failed = self.attempt(lambda: torch_side.with_lora(
            self.mods, base, self.settings.rank, half=dtype == "f16"))
        return Side(model, None if failed is None else f"peft model not built: {failed}",
                    failed is not None)

    def new_row(self, name: str, what: str, ours: Side, theirs: Side, **sizes) -> dict:
        row = {"model": name, "row": what, **sizes, "errors": {}}
        for key, side in (("ours", ours), ("torch", theirs)):
            if side.failed:
                row["errors"][key] = side.why
            elif side.why:
                row[f"{key}_why"] = side.why
        return row

    # ------------------------------------------------------------ rows

    def train_row(self, name: str, dtype: str, config: dict, ours: Side, theirs: Side) -> dict:
        s = self.settings
        row = self.new_row(name, f"train {dtype}", ours, theirs, dtype=dtype,
                           batch=s.train_batch, seq=s.train_seq)
        ids = token_ids(s.train_batch, s.train_seq, config["vocab_size"])
        lm = ours.model
        if lm is not None:
            put(row, "ours", self.section(row, "ours", lambda: {
                **ours_side.train_times(lm, ids, s.steps, s.repeats),
                **ours_side.memory(lm)}), ids.size)
        if theirs.model is None:
            return row
        half = dtype == "f16"
        put(row, "torch", self.section(row, "torch", lambda: torch_side.train_times(
            self.mods, theirs.model, ids, half, False, s.steps, s.repeats)), ids.size)
        why = torch_side.why_no_compile(self.mods, self.torch_device) if half else None
        if why is not None:
            row["torch_compiled_why"] = why
        elif half:  # the f32 rows are beside eager alone
            put(row, "torch_compiled", self.section(row, "torch_compiled", lambda: (
                torch_side.train_times(self.mods, theirs.model, ids, half, True, s.steps,
                                       s.repeats))), ids.size)
        return row

    def generate_rows(self, name: str, config: dict, ours: Side, theirs: Side) -> list[dict]:
        """The prefill and decode rows of each batch of generation."""
        s, rows = self.settings, []
        for batch in s.gen_batches:
            prompt = token_ids(batch, s.prompt, config["vocab_size"], seed=batch)
            sizes = dict(dtype="f16", batch=batch, prompt=s.prompt)
            pre = self.new_row(name, f"prefill b{batch}", ours, theirs, **sizes)
            dec = self.new_row(name, f"decode b{batch}", ours, theirs, **sizes,
                               new_tokens=s.new_tokens)
            news = {key: self._generated(pre, dec, key, generate, memory, prompt)
                    for key, generate, memory in self._generators(ours, theirs)}
            if news.get("ours") is not None and news.get("torch") is not None:
                dec["same_tokens"] = float(np.mean(news["ours"] == news["torch"]))
            if ours.model is not None:
                self._generate_gpu(pre, dec, ours.model, prompt)
            rows += [pre, dec]
        return rows

    def _generate_gpu(self, pre: dict, dec: dict, lm, prompt: np.ndarray) -> None:
        """Our prefill's and decode step's GPU time and shares into their rows, and the
        memory a generate of this shape holds into the decode row."""
        s = self.settings
        got = self.section(dec, "ours_gpu", lambda: ours_side.generate_gpu(
            lm, prompt, s.new_tokens, s.steps, s.repeats))
        if got is None:
            pre["errors"]["ours_gpu"] = dec["errors"]["ours_gpu"]
            return
        for row, what in ((pre, "prefill"), (dec, "decode")):
            put(row, "ours", got[what], prompt.size)
        dec["ours_bytes"] = got["bytes"]

    def _generators(self, ours: Side, theirs: Side) -> list:
        """(key, generate, memory) of each side that generates here; ``memory(prompt)``:
        the side's memory fields of a decode row (None: none)."""
        out: list = []
        n = self.settings.new_tokens
        if ours.model is not None:
            out.append(("ours", ours_side.generator(ours.model), None))
        if theirs.model is not None:
            generate = torch_side.generator(self.mods, theirs.model)
            out += [("torch", generate, lambda prompt: {"torch_bytes": torch_side.peak_bytes(
                        self.mods, self.torch_device, lambda: generate(prompt, n))}),
                    ("torch_no_lora", torch_side.generator(self.mods, theirs.model, False), None)]
        return out

    def _generated(self, pre: dict, dec: dict, key: str, generate, memory, prompt):
        """Time ``generate`` into the prefill and decode rows, and its ``memory``
        into the decode row; the new tokens, or None where it failed."""
        s = self.settings
        times = self.section(dec, key, lambda: generate_times(generate, prompt, s.new_tokens,
                                                              s.gen_repeats))
        if times is None:
            pre["errors"][key] = dec["errors"][key]
            return None
        r = rates(prompt.shape[0], s.prompt, s.new_tokens, times["t1_s"], times["tn_s"])
        for row, what in ((pre, "prefill"), (dec, "decode")):
            row[f"{key}_ms"], row[f"{key}_tok_s"] = r[f"{what}_ms"], r[f"{what}_tok_s"]
        if memory is not None:
            dec.update(self.section(dec, f"{key}_memory", lambda: memory(prompt)) or {})
        return times["new"]


def put(row: dict, key: str, got: dict | None, tokens: int) -> None:
    """A side's measurements into ``row``: each as ``<key>_<name>`` (the shares as
    they are), and its tokens per second from ``ms``."""
    if got is None:
        return
    for name, value in got.items():
        row[name if name.endswith("_share") else f"{key}_{name}"] = value
    if "ms" in got:
        row[f"{key}_tok_s"] = tokens / got["ms"] * 1e3
# ---------------------------------------------------------------- the table

COLUMNS = (  # (heading, row key, format)
    ("model", "model", "text"), ("row", "row", "text"), ("ours ms", "ours_ms", "ms"),
    ("GPU ms", "ours_gpu_ms", "ms"), ("ours tok/s", "ours_tok_s", "rate"),
    ("torch tok/s", "torch_tok_s", "rate"), ("x torch", "vs_torch", "x"),
    ("compiled tok/s", "torch_compiled_tok_s", "rate"), ("x compiled", "vs_torch_compiled", "x"),
    ("no-LoRA tok/s", "torch_no_lora_tok_s", "rate"), ("x no-LoRA", "vs_torch_no_lora", "x"),
    ("base", "base_share", "share"), ("attn", "attention_share", "share"),
    ("rest", "rest_share", "share"), ("ours MiB", "ours_bytes", "mib"),
    ("torch MiB", "torch_bytes", "mib"))
FORMATS = {"text": str, "ms": lambda v: f"{v:.2f}", "rate": lambda v: f"{v:.0f}",
           "x": lambda v: f"{v:.2f}x", "share": lambda v: f"{100 * v:.0f}%",
           "mib": lambda v: f"{v / 2**20:.0f}"}
LEGEND = ("ms: a training step, a prefill (generate with 1 new token) or a decode step "
          "(wall time); GPU ms: our GPU time by timestamps (the step, generate's prefill, "
          "one decode step); tok/s: tokens per second; x: ours' tokens per second over "
          "theirs (above 1: ours is faster); base, attn, rest: shares of our GPU time in the "
          "frozen base products (dense*), attention (attention*) and everything else; MiB: "
          "lm.memory() (decode: with a generate's graphs and KV cache), "
          "torch.cuda.max_memory_allocated")


def cell(row: dict, key: str, form: str) -> str:
    value = row.get(key)
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return "-"
    return FORMATS[form](value)


def table(rows: list[dict]) -> list[str]:
    """The lines of the table of ``rows``, then why a cell is empty where it is."""
    head = [c[0] for c in COLUMNS]
    body = [[cell(r, key, form) for _, key, form in COLUMNS] for r in rows]
    widths = [max(len(c) for c in column) for column in zip(head, *body)]
    lines = [LEGEND] + ["  ".join(c.rjust(w) for c, w in zip(cells, widths))
                        for cells in [head, *body]]
    return lines + reasons(rows)


def reasons(rows: list[dict]) -> list[str]:
    """One line per distinct reason a side is missing or failed, with its rows."""
    said: dict[tuple, list[str]] = {}
    for r in rows:
        why = {k[:-4]: v for k, v in r.items() if k.endswith("_why") and v}
        for key, text in [*why.items(), *((k, f"failed: {v}") for k, v in r["errors"].items())]:
            said.setdefault((key, text), []).append(f"{r['model']} {r['row']}")
    return [f"  {key}: {text} ({'every row' if len(where) == len(rows) else ', '.join(where)})"
            for (key, text), where in said.items()]


def row_line(row: dict) -> str:
    """A row as the log prints it when it is measured."""
    parts = [f"{row['model']} {row['row']}:"]
    for label, key, form in COLUMNS[2:]:
        text = cell(row, key, form)
        if text != "-":
            parts.append(f"{label} {text}")
    if "ours_loss" in row or "torch_loss" in row:  # the first step's: the same model and ids
        parts.append(f"first loss ours {row.get('ours_loss', float('nan')):.4f} torch "
                     f"{row.get('torch_loss', float('nan')):.4f}")
    if "same_tokens" in row:
        parts.append(f"same tokens as torch {100 * row['same_tokens']:.0f}%")
    if row["errors"]:
        parts.append(f"({len(row['errors'])} failed: {', '.join(row['errors'])})")
    return " ".join(parts)


def parse_table(lines: list[str]) -> list[dict]:
    """The rows of a printed table back as {heading: text} (the tests read the output)."""
    head = [c[0] for c in COLUMNS]
    split = [re.split(r"\s{2,}", line.strip()) for line in lines]
    start = next(i for i, cells in enumerate(split) if cells == head)
    out = []
    for cells in split[start + 1:]:
        if len(cells) != len(head) or cells[0] not in MODELS:
            break
        out.append(dict(zip(head, cells)))
    return out


# ---------------------------------------------------------------- the command

def json_name(models, parts) -> str:
    """``lm-<compiler>.json``, the models and parts named where a run has some of them
    (so that runs split by model or part do not overwrite each other)."""
    some = [m.lower() for m in models or () if set(models) != set(MODELS)]
    some += [p for p in parts if set(parts) != set(PARTS)]
    return f"lm-{'-'.join([COMPILER, *some])}.json"


def lm_main(out_dir: str, log=print, quick: bool = False, models=None, parts=PARTS,
            **changes) -> int:
    """Every row of ``models`` (MODELS' names; default all) and ``parts`` ("train",
    "generate") with the settings of FULL or QUICK, ``changes`` (Settings' fields)
    made; the JSON to ``out_dir``; 0, or 1 where one of our sections failed."""
    settings = replace(QUICK if quick else FULL, **changes)
    device = get_device()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, json_name(models, parts))
    result = {"adapter": device.name, "backend": device.backend, "wgpu_build": WGPU_BUILD,
              "compiler": COMPILER, "quick": quick, "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "settings": asdict(settings),
              "models": {name: model_config(name, quick) for name in models or MODELS},
              "rows": []}

    def save(rows):
        result["rows"] = rows
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(path + ".tmp", path)

    run = Run(device, settings, quick, log, save)
    result.update(torch_device=run.torch_device or None, torch=run.torch_why or
                  torch_side.versions(run.mods))
    log(f"adapter: {device.name} ({device.backend}), wgpu build {WGPU_BUILD} ({COMPILER}); "
        f"torch: {result['torch']}{f' on {run.torch_device}' if run.torch_device else ''}")
    if not quick:  # an idle GPU's clocks take a while to rise (optimisation notes 16, 27)
        result["copy_gbps"] = copy_bandwidth(device, 256, 3.0)
    for name in models or MODELS:
        run.model(name, parts)
    save(run.rows)
    for line in table(run.rows):
        log(line)
    log(f"wrote {path}")
    return 1 if any(k.startswith("ours") for r in run.rows for k in r["errors"]) else 0
