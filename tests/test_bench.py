"""``python -m lora bench --quick``: the JSON it writes and the plot.

The quick matrix (f32 and f16, tokens 1 and 16, rank 8, 256 -> 320) runs
once for the module; every test reads its output. Accuracy fields are the
bench's own relative errors (|gpu - numpy| / (1 + the forward on absolute
values)), held to 1e-5 for f32 and to 2**-11 (float16's rounding of the
result) for f16. Nothing here asserts a speed: only that the timings are
there, positive, and consistent with each other.
"""
from __future__ import annotations

import importlib.util
import json
import math
import re
import time
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import h200_interp

from lora import Strategy
from lora.apps import bench, bench_lm, bench_lm_torch, bench_train
from lora.core import tuning
from shaderdsl.runtime import COMPILER, WGPU_BUILD


# bench --quick takes over a minute on lavapipe: the tests that read it are slow.
@pytest.fixture(scope="module")
def quick(tmp_path_factory, device):
    out = tmp_path_factory.mktemp("bench")
    code = bench.main(["--quick", "--out", str(out)])
    return code, out


@pytest.fixture(scope="module")
def results(quick):
    _, out = quick
    path = out / f"bench-{COMPILER}.json"
    assert path.exists(), sorted(p.name for p in out.iterdir())
    with open(path) as f:
        return json.load(f)


def positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and value > 0


@pytest.mark.slow
def test_exit_code_and_files(quick):
    code, out = quick
    assert code == 0
    assert (out / f"bench-{COMPILER}.json").is_file()
    if COMPILER == "naga":
        assert (out / "bench-naga.json").is_file()


@pytest.mark.slow
def test_header(results, device):
    for key in ("adapter", "backend", "wgpu_build", "compiler", "copy_gbps",
                "dispatch_floor_us", "rows"):
        assert key in results, key
    assert results["adapter"] == device.name
    assert results["backend"] == device.backend
    assert results["wgpu_build"] == WGPU_BUILD
    assert results["compiler"] == COMPILER
    assert results["quick"] is True
    assert positive(results["copy_gbps"])
    floor = results["dispatch_floor_us"]
    assert isinstance(floor, float) and (math.isnan(floor) or floor > 0)


@pytest.mark.slow
def test_rows_cover_the_quick_matrix(results, device):
    rows = results["rows"]
    dtypes = ["f32", "f16"] if device.has_feature("shader-f16") else ["f32"]
    assert [(r["dtype"], r["tokens"], r["rank"]) for r in rows] == \
        [(d, t, 8) for d in dtypes for t in (1, 16)]
    for r in rows:
        assert r["in_dim"] >= 1 and r["out_dim"] >= 1
    if "f16" not in dtypes:
        assert results["skipped"] == ["f16: adapter lacks shader-f16"]
    else:
        assert results["skipped"] == []


@pytest.mark.slow
def test_row_fields(results, device):
    for r in results["rows"]:
        where = f"row T={r['tokens']} r={r['rank']}"
        s = Strategy.parse(r["strategy"])
        assert str(s) == r["strategy"], where
        cands = tuning.candidates(device, r["rank"], r["in_dim"], r["out_dim"], r["tokens"])
        assert r["strategy"] in {str(c) for c in cands}, where
        for key in ("best_gpu_us", "seed_gpu_us", "host_us", "gbps", "numpy_us"):
            assert positive(r.get(key)), (where, key, r.get(key))
        for key in ("best_rel_err", "seed_rel_err"):
            assert 0 <= r[key] < (1e-5 if r["dtype"] == "f32" else 2.0 ** -11), (where, key, r[key])
        assert r["vs_seed"] == pytest.approx(r["seed_gpu_us"] / r["best_gpu_us"], rel=1e-9)
        assert r["vs_numpy"] == pytest.approx(r["numpy_us"] / r["best_gpu_us"], rel=1e-9)
        assert r["gbps"] == pytest.approx(r["min_bytes"] / (r["best_gpu_us"] * 1e3), rel=1e-9)
        assert r["min_bytes"] == bench.minimal_bytes(r["tokens"], r["rank"], r["in_dim"],
                                                     r["out_dim"], 4 if r["dtype"] == "f32" else 2)
        assert r["frac_copy"] == pytest.approx(r["gbps"] / results["copy_gbps"], rel=1e-9)
        assert r["dispatches"] == (2 if s.name in ("seed", "split") else 1), where


@pytest.mark.slow
def test_torch_field(results):
    for r in results["rows"]:
        torch = r["torch"]
        assert isinstance(torch, str) and torch, r
        if torch == "not installed" or torch.endswith("without CUDA"):
            assert "torch_eager_us" not in r and "torch_graph_us" not in r
        else:  # a version string, with CUDA timings
            assert torch[0].isdigit(), torch
            for key in ("torch_eager_us", "torch_graph_us"):
                assert positive(r[key]), (key, r.get(key))


@pytest.mark.slow
def test_one_token_row_has_alone_read(results):
    one = [r for r in results["rows"] if r["tokens"] == 1]
    assert one
    for r in one:
        assert positive(r["alone_read_us"])


@pytest.mark.slow
def test_plot(quick):
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed: the bench writes no plot")
    _, out = quick
    png = out / "bench.png"
    assert png.is_file()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_dtype_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--dtypes", "f32,bf16", "--out", str(tmp_path)])
    assert "--dtypes: unknown bf16; expected f32 and/or f16" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_tokens_sweep_quick(tmp_path):
    """python -m lora bench --tokens-sweep --quick: the run-time loop compiles
    nothing after its warm-up, the baked loop compiles per new count. The strategy
    is forced: the autotuner's warm-up (tuning each bucket: 48 s of compiles on
    lavapipe) is tests/test_runtime_tokens.py's."""
    from lora.apps.bench import main
    assert main(["--tokens-sweep", "--quick", "--forwards", "12", "--baked-forwards", "4",
                 "--strategy", "tiled:256:4", "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("tokens-sweep-*.json")).read_text())
    case = result["rows"][0]
    assert case["runtime"]["modules"] == 0 and case["runtime"]["pipelines"] == 0


@pytest.mark.slow  # a bench run
def test_profile_small(tmp_path, monkeypatch, device):
    """``bench --profile`` on small shapes: every strategy timed whole, the
    multi-dispatch ones by dispatch, tiled by phase, and the read-back's pieces."""
    from lora.apps import bench_profile
    monkeypatch.setattr(bench_profile, "DIM", 64)
    monkeypatch.setattr(bench_profile, "CASES", (
        (8, 32, "f32", ("tiled:64:8", "gemm:64:8:2", "single:64:2", "tiled:8:8:too-many")),
        (8, 32, "f16", (HALF_PAIRED,))))
    assert bench.main(["--profile", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / f"profile-{COMPILER}.json").read_text())
    assert result["adapter"] == device.name and result["build"] == WGPU_BUILD
    assert set(result["read"]) >= {"forward + read", "read alone", "sync alone",
                                   "read alone (map_sync)", "record + submit"}
    assert all(positive(v) for v in result["read"].values())
    case = result["cases"][0]
    strategies = case["strategies"]
    assert set(strategies["tiled:64:8"]) == {"us", "phase h", "phase out"}
    assert set(strategies["gemm:64:8:2"]) == {"us", "0:project_a_tiled", "1:tiled_b_add"}
    assert set(strategies["single:64:2"]) == {"us"}
    assert "error" in strategies["tiled:8:8:too-many"]
    assert all(positive(v) for s in list(strategies.values())[:3] for v in s.values())
    if device.has_feature("shader-f16"):  # half's phase h (f16 sums) timed alone too
        half = result["cases"][1]["strategies"][HALF_PAIRED]
        assert set(half) == {"us", "phase h", "phase out"} and all(map(positive, half.values()))


HALF_PAIRED = "tiled(threads=64, tile_tokens=8, token_block=2, quad=True, half=True)"


@pytest.mark.slow
def test_gemm_case_in_the_interpreter():
    """``--gemm``'s case on the interpreter device (the H200's matrix shapes and
    workgroup memory): the rule's variant of a linear layer's product runs, is
    checked against float64 before it is timed, and times (some 15 dispatches)."""
    from lora.apps.bench_gemm import gemm_case, variants

    chosen = variants(64, 48, 32, "linear")[:1]
    row = gemm_case(h200_interp(), (64, 48, 32, "linear"), lambda *a: None, chosen)
    assert len(row["tilings"]) == 1 and not row["refused"]
    for r in row["tilings"].values():
        assert r["us"] > 0 and r["right"] and r["rel_err"] < 2.0**-10


def test_gemm_shapes_are_parsed():
    from lora.apps.bench_gemm import ISSUE_SHAPES, parse_shapes

    assert parse_shapes("issue") == ISSUE_SHAPES
    assert parse_shapes("64,4096x576x576") == ((64, 64, 64, "plain"), (4096, 576, 576, "linear"))
    with pytest.raises(ValueError, match="expected 'issue', sizes"):
        parse_shapes("64x64")


@pytest.mark.slow   # 13.9 s on lavapipe cold: every attention kernel of the bench compiled
def test_attention_quick(tmp_path, capsys, device):
    """bench --attention --quick: every kernel of the tiny shape in each dtype
    the device has (SIMT padded and not; the matrix forms where it has
    fragments), each checked against float64 and timed, and the layer sums."""
    from lora.apps.bench_attention import PRODUCTS
    assert bench.main(["--attention", "--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / f"attention-{COMPILER}.json") as f:
        saved = json.load(f)
    (shape,) = saved["shapes"]
    dtypes = ["f32"] + (["f16"] if device.has_feature("shader-f16") else [])
    for dtype in dtypes:
        rows = [r for r in shape["rows"] if r["dtype"] == dtype]
        assert {(r["kind"], r["variant"]) for r in rows} >= {
            (k, v) for k in PRODUCTS for v in ("", "unpadded") if k != "delta" or not v}
        assert all(r["us"] > 0 and not r["wrong"] for r in rows), rows
        assert shape["layer"][dtype]["model_us"] >= shape["layer"][dtype]["fastest_us"] > 0
    assert "forward + backward: ours" in capsys.readouterr().out


def test_attention_refused_kernel_is_recorded_and_the_run_goes_on(monkeypatch):
    """A kernel the device refuses (a DispatchError, as an over-limit tiling
    raises) becomes a row with its error, counted wrong; the next kernel runs."""
    from lora.apps import bench_attention
    from shaderdsl import interp
    from shaderdsl.errors import DispatchError

    class Refused:
        def kernel(self, **params):
            raise DispatchError("over max-compute-workgroup-storage-size")

    monkeypatch.setattr(bench_attention, "KERNELS",
                        {**bench_attention.KERNELS, "attention_grad_q": Refused()})
    monkeypatch.setattr(bench_attention, "median_us", lambda device, record, n: 1.0)
    run = bench_attention.ShapeRun(interp.Device(), ("tiny", 1, 8, 2, 1, 4), "f32",
                                   lambda *a: None)
    assert run.run("grad_q", "attention_grad_q", {}, (), ("dq",)) is None
    forward = run.run("forward", "attention", run.params(q_len=8, kv_len=8),
                      bench_attention.FORWARD, ("o", "lse"))
    assert run.rows[0]["wrong"] and "max-compute" in run.rows[0]["error"]
    assert forward is not None and not forward["wrong"]


@pytest.mark.slow  # about 30 s: the interpreter runs every matrix tiling
def test_attention_matrix_rows_in_the_interpreter(tmp_path, monkeypatch):
    """bench --attention's matrix rows on the interpreter's fragments: the
    matrix forward and every matrix backward tiling within 16 KiB, each
    checked against float64 (the timer replaced: the interpreter's times mean
    nothing, and timing it would take minutes)."""
    from lora.apps import bench_attention
    from shaderdsl import interp
    monkeypatch.setattr(bench_attention, "median_us", lambda device, record, n: 1.0)
    dev = interp.Device(subgroup_size=32, limits={"max-compute-workgroup-storage-size": 16384})
    shape = ("tiny", 1, 20, 2, 1, 16)
    assert bench_attention.attention_main(str(tmp_path), lambda *a: None, device=dev,
                                          shapes=(shape,)) == 0
    with open(tmp_path / f"attention-{COMPILER}.json") as f:
        rows = json.load(f)["shapes"][0]["rows"]
    matrix = [r for r in rows if r["variant"].startswith("matrix")]
    tilings = bench_attention.matrix_tilings(shape, 16384)
    assert len(matrix) == 1 + 2 * len(tilings) and len(tilings) >= 2
    assert not any(r["wrong"] for r in rows)


def test_gemm_refused_without_matrix_units(tmp_path, capsys, device):
    if device.subgroup_matrix_configs:
        pytest.skip(f"{device.name} has subgroup matrices: the GEMM runs")
    assert bench.main(["--gemm", "64", "--out", str(tmp_path)]) == 1
    assert "has no f16->f32 16x16x16 subgroup matrices" in capsys.readouterr().out


SMALL_CEILINGS = {"mib": 1 / 16, "rows": 32, "cols": 128, "loops": 1, "groups": 2, "gemm": 64}


def one_dispatch_us(device, kernel, bufs, grid) -> float:
    """Microseconds of one dispatch (and its wait): on the interpreter a time is no
    figure, and bench_ceiling.batch_us's timing batches (tuning.median_us: a warm-up,
    a sizing batch and five repeats, 14 dispatches of each kernel) cost 8x the run."""
    start = time.perf_counter()
    device.dispatch(kernel, bufs, grid)
    device.sync()
    return (time.perf_counter() - start) * 1e6


def test_ceilings_in_the_interpreter(tmp_path, monkeypatch):
    """``--ceiling``'s kernels on the interpreter device (the H200's matrix
    shapes): each runs and its output checks against float64 (a copy equal to
    its source, sums equal to their value); the JSON names the robustness. Each
    kernel runs once (one_dispatch_us); test_ceiling_copies_on_the_device times them."""
    from lora.apps import bench_ceiling
    from lora.apps.bench_ceiling import COPY_SHAPES, ceiling_main, robustness_label

    monkeypatch.setattr(bench_ceiling, "batch_us", one_dispatch_us)
    assert ceiling_main(str(tmp_path), lambda *a: None, SMALL_CEILINGS, h200_interp()) == 0
    # the name says the process's build (under Dawn: its toggles), not the interpreter's
    with open(tmp_path / f"ceiling-{COMPILER}-{robustness_label()}.json") as f:
        result = json.load(f)
    assert len(result["copy"]) == sum(t <= 256 for t, _ in COPY_SHAPES)  # its workgroup cap
    names = [r["kernel"] for r in result["fragments"]]
    for part in ("fragment copy", "workgroup memory", "multiply only", "direct", "staged"):
        assert any(part in n for n in names), (part, names)
    for row in result["copy"] + result["fragments"]:
        assert row["checked"] and positive(row["us"]), row


def test_ceiling_copies_on_the_device(tmp_path, device, capsys):
    """On the test device: the copies run and check; the fragment rows are left
    out, with a message, where the adapter has no subgroup matrices."""
    from lora.apps.bench_ceiling import ceiling_main

    assert ceiling_main(str(tmp_path), print, {**SMALL_CEILINGS, "mib": 1}) == 0
    if not device.subgroup_matrix_configs:
        assert "fragment rows left out" in capsys.readouterr().out


@pytest.mark.slow  # four training rows of the quick matrix, each checked and timed
def test_training_rows_for_several_backwards(tmp_path, device):
    """--backward times each training step with each strategy (default: the
    trainer's), every row checked against float64 first."""
    assert bench.main(["--quick", "--train", "only", "--backward", "default,gemm:64",
                       "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / f"bench-{COMPILER}.json").read_text())["train_rows"]
    assert [r["tokens"] for r in rows] == [1, 1, 16, 16]
    assert [r["backward"] == "gemm(threads=64)" for r in rows] == [False, True, False, True]
    assert all(r["rel_err"] < 1e-5 and positive(r["gpu_us"]) for r in rows)
    for r in rows:  # PyTorch's strongest step: timed, or why not
        measured = r["torch_strongest"] == bench_train.STRONGEST
        assert measured == positive(r.get("torch_strongest_us")), r
        assert measured or r["torch_strongest"].startswith(("failed: ", r["torch"].split()[0]))


def test_training_rows_take_the_given_subset(tmp_path, device):
    """--tokens, --ranks and --dims choose the training rows too (they were
    always the training matrix's own, whatever was asked)."""
    assert bench.main(["--quick", "--train", "only", "--tokens", "3", "--ranks", "4",
                       "--dims", "16x24", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / f"bench-{COMPILER}.json").read_text())["train_rows"]
    assert [(r["tokens"], r["rank"], r["in_dim"], r["out_dim"]) for r in rows] == [(3, 4, 16, 24)]
    assert rows[0]["rel_err"] < 1e-5


def fake_torch(cuda: bool, device=None):
    """A stand-in for an installed torch, with or without CUDA; ``device``
    replaces torch.device (to make building the step fail)."""
    return SimpleNamespace(__version__="2.9.0", device=device,
                           cuda=SimpleNamespace(is_available=lambda: cuda))


def test_strongest_torch_step_says_why_not(monkeypatch):
    """PyTorch's strongest training step, where it cannot run, leaves its time
    out and says why: torch missing, no CUDA, no triton, or compile failing."""
    from lora.apps import bench_train

    problem = bench_train._problem(2, 4, 8, 8)

    def strongest(torch, *, triton=True):
        monkeypatch.setattr(bench_train, "optional_torch", lambda: torch)
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
            (object() if triton else None) if name == "triton" else real(name, *a)))
        return bench_train.torch_strongest_time(*problem, steps=2)

    assert strongest(None) == {"torch_strongest": "not installed"}
    assert strongest(fake_torch(cuda=False)) == {"torch_strongest": "2.9.0 without CUDA"}
    assert strongest(fake_torch(cuda=True), triton=False) == {
        "torch_strongest": "2.9.0 without triton (torch.compile's GPU kernels)"}

    def broken(name):
        raise RuntimeError("CUDA error: no kernel image is available\nsecond line")

    assert strongest(fake_torch(cuda=True, device=broken)) == {
        "torch_strongest": "failed: RuntimeError: CUDA error: no kernel image is available"}


def test_training_rows_say_why_torch_is_missing(tmp_path, monkeypatch, capsys, device):
    """With a torch that has no CUDA the training row carries on without
    PyTorch's times; its JSON and the closing table say why."""
    from lora.apps import bench_train

    monkeypatch.setattr(bench_train, "optional_torch", lambda: fake_torch(cuda=False))
    assert bench.main(["--quick", "--train", "only", "--tokens", "2", "--ranks", "4",
                       "--dims", "16x24", "--dtypes", "f32", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / f"bench-{COMPILER}.json").read_text())["train_rows"]
    assert row["torch"] == row["torch_strongest"] == "2.9.0 without CUDA"
    assert not any(k.endswith("_us") and k.startswith("torch") for k in row), row
    assert not any(k.startswith("vs_torch") for k in row), row
    out = capsys.readouterr().out
    assert "PyTorch: 2.9.0 without CUDA" in out
    assert "no torch strongest: 2.9.0 without CUDA" in out
    table = out[out.index("training: GPU us per step"):].splitlines()
    assert table[1].split() == ["dtype", "T", "rank", "in->out", "ours", "us", "torch", "graph",
                                "us", "vs", "graph", "torch", "strongest", "us", "vs", "strongest"]
    cells = table[2].split()
    assert cells[:4] == ["f32", "2", "4", "16->24"] and cells[5:] == ["-"] * 4
    assert float(cells[4]) == pytest.approx(row["gpu_us"], abs=0.051)


def test_tables_put_pytorch_beside_ours():
    """The closing tables: an f16 training row beside PyTorch's fp16 autocast
    graph and strongest step, a forward row beside its graph, ratios as given."""
    from lora.apps.bench_table import tables

    shape = {"tokens": 4096, "rank": 64, "in_dim": 2560, "out_dim": 2560}
    train = {"kind": "train", "dtype": "f16", **shape, "gpu_us": 314.4, "torch": "2.11",
             "torch_fp16_graph_us": 395.8, "vs_torch_graph": 395.8 / 314.4,
             "torch_fp16_strongest_us": 155.5, "vs_torch_strongest": 155.5 / 314.4,
             "torch_graph_us": 1.0}  # an f32 figure: not the f16 row's
    forward = {"dtype": "f32", **shape, "best_gpu_us": 141.2, "torch": "2.11",
               "torch_graph_us": 110.7, "vs_torch_graph": 110.7 / 141.2}
    lines = tables({"rows": [forward], "train_rows": [train]})
    assert lines[2].split() == ["f32", "4096", "64", "2560->2560", "141.2", "110.7", "0.78x"]
    assert lines[5].split() == ["f16", "4096", "64", "2560->2560", "314.4", "395.8", "1.26x",
                                "155.5", "0.49x"]
    assert len(lines) == 6


@pytest.mark.slow  # about 20 s on lavapipe: four forms of each quick case (f32) built and timed
def test_many_quick(tmp_path, device):
    """``--many --quick``: every case's fastest form matches float64, each row
    has its floor, its best form among QUICK_FORMS, and says why PyTorch is
    missing where it is."""
    from lora.apps.bench_many import ONE_ADAPTER, QUICK_FORMS
    from lora.core.many_plan import CANDIDATES

    assert bench.main(["--many", "--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / f"many-{COMPILER}.json") as f:
        rows = json.load(f)["rows"]
    assert {(r["kind"], r["adapters"]) for r in rows} == \
        {(k, n) for k in ("decode", "prefill") for n in (1, 4)}
    for r in rows:
        assert r["correct"] and r["best"] in QUICK_FORMS + (ONE_ADAPTER,), r
        assert positive(r["us"]) and positive(r["floor_us"]) and ("loop_us" in r or r["why"]), r
        assert ("one_adapter_us" in r) == (r["adapters"] == 1) == (ONE_ADAPTER in r["forms"]), r
        assert r["chosen"] in CANDIDATES, r


def test_many_torch_baselines_say_why_they_are_missing(monkeypatch):
    """Without PyTorch, or with PyTorch but no CUDA, the baselines are a reason."""
    from lora.apps import bench_many, bench_many_torch

    case = bench_many.make_case("f32", "decode", [4, 8], bench_many.QUICK_DIM)
    monkeypatch.setattr(bench_many_torch, "optional_torch", lambda: None)
    assert bench_many_torch.torch_many_us(case) == {"why": "torch is not installed"}

    class NoCuda:
        __version__ = "9.9"

        class cuda:
            @staticmethod
            def is_available():
                return False

    monkeypatch.setattr(bench_many_torch, "optional_torch", lambda: NoCuda)
    assert bench_many_torch.torch_many_us(case) == {"why": "torch 9.9 without CUDA"}


def test_torch_copy_asks_torch_for_a_whole_count(monkeypatch):
    """A fractional MiB (the tests' small ceilings) reaches torch.ones as an
    int: with CUDA present the H200 raised TypeError for a float count."""
    from lora.apps import bench_ceiling

    class Stop(Exception):
        pass

    class FakeTorch:
        class cuda:
            @staticmethod
            def is_available():
                return True

        @staticmethod
        def ones(n, device):
            assert isinstance(n, int) and n == (1 << 18) // 16, n
            raise Stop

    monkeypatch.setattr(bench_ceiling, "optional_torch", lambda: FakeTorch)
    with pytest.raises(Stop):
        bench_ceiling.torch_copy_gbps(1 / 16)


# ---------------------------------------------------------------- bench --lm

def test_lm_arguments():
    """--lm's options: model names in any case, parts, the sections' time limit."""
    args = bench._parser().parse_args([
        "--lm", "--quick", "--lm-models", "smollm2-135m,QWEN2.5-0.5B", "--lm-parts", "train",
        "--lm-timeout", "30", "--lm-train-shape", "4x256"])
    assert args.lm and args.quick
    assert args.lm_models == ("SmolLM2-135M", "Qwen2.5-0.5B")
    assert args.lm_parts == ("train",)
    assert args.lm_timeout == 30.0
    assert args.lm_train_shape == (4, 256)
    defaults = bench._parser().parse_args(["--lm"])
    assert (defaults.lm_models, defaults.lm_parts, defaults.lm_timeout,
            defaults.lm_train_shape) == (None, bench_lm.PARTS, None, None)


def test_lm_unknown_model_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--lm", "--lm-models", "gpt2", "--out", str(tmp_path / "out")])
    assert "unknown gpt2; expected some of SmolLM2-135M, Qwen2.5-0.5B" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_lm_json_names_a_subset():
    assert bench_lm.json_name(None, bench_lm.PARTS) == f"lm-{COMPILER}.json"
    assert bench_lm.json_name(tuple(bench_lm.MODELS), ("generate", "train")) == \
        f"lm-{COMPILER}.json"
    assert bench_lm.json_name(("Qwen2.5-0.5B",), ("train",)) == \
        f"lm-{COMPILER}-qwen2.5-0.5b-train.json"


def test_lm_rates_and_ratios():
    """Prefill: the prompt's tokens over generate(1)'s time; decode: the later new
    tokens over the rest of generate(n)'s; x: ours' tokens per second over theirs."""
    r = bench_lm.rates(batch=8, prompt=128, new_tokens=128, t1_s=0.5, tn_s=2.405)
    assert r["prefill_ms"] == pytest.approx(500.0)
    assert r["prefill_tok_s"] == pytest.approx(2048.0)
    assert r["decode_ms"] == pytest.approx(1905.0 / 127)
    assert r["decode_tok_s"] == pytest.approx(8 * 127 / 1.905)
    assert math.isnan(bench_lm.rates(1, 8, 4, t1_s=0.2, tn_s=0.1)["decode_tok_s"])
    row = {"ours_tok_s": 300.0, "torch_tok_s": 100.0, "torch_compiled_tok_s": 600.0}
    bench_lm.ratios(row)
    assert (row["vs_torch"], row["vs_torch_compiled"]) == (3.0, 0.5)
    assert "vs_torch_no_lora" not in row


def test_lm_generate_times_refuse_a_wrong_shape():
    prompt = np.zeros((2, 3), np.int64)
    with pytest.raises(ValueError, match=r"shape \[2, 4\], expected \[2, 7\]"):
        bench_lm.generate_times(lambda p, n: np.zeros((2, 4), np.int64), prompt, 4, 1)
    got = bench_lm.generate_times(lambda p, n: np.concatenate([p, np.ones((2, n), np.int64)], 1),
                                  prompt, 4, 2)
    assert got["new"].shape == (2, 4) and (got["new"] == 1).all()
    assert 0 < got["t1_s"] < 1 and 0 < got["tn_s"] < 1


def test_lm_time_limit_ends_a_section():
    t0 = time.perf_counter()
    with pytest.raises(bench_lm.SectionTimeout, match="over its 0.2 s limit"):
        with bench_lm.time_limit(0.2):
            while True:
                time.sleep(0.01)
    assert time.perf_counter() - t0 < 2
    with bench_lm.time_limit(0.05):
        pass
    time.sleep(0.1)  # the timer is off once the block is left


def test_lm_table_lists_every_row_and_says_why_cells_are_empty():
    rows = [{"model": "SmolLM2-135M", "row": "train f16", "errors": {}, "ours_ms": 12.5,
             "ours_gpu_ms": 10.0, "ours_tok_s": 327680.0, "torch_tok_s": 163840.0,
             "base_share": 0.5, "attention_share": 0.2, "rest_share": 0.3,
             "ours_bytes": 3 * 2**20, "torch_compiled_why": "not on the CPU"},
            {"model": "Qwen2.5-0.5B", "row": "decode b8", "errors": {"torch": "SectionTimeout: "
             "over its 1 s limit"}, "ours_ms": 5.0, "ours_tok_s": float("nan")}]
    for r in rows:
        bench_lm.ratios(r)
    lines = bench_lm.table(rows)
    got = bench_lm.parse_table(lines)
    assert [(r["model"], r["row"]) for r in got] == [("SmolLM2-135M", "train f16"),
                                                     ("Qwen2.5-0.5B", "decode b8")]
    assert (got[0]["ours ms"], got[0]["x torch"], got[0]["base"], got[0]["ours MiB"]) == \
        ("12.50", "2.00x", "50%", "3")
    assert (got[1]["ours tok/s"], got[1]["torch tok/s"], got[1]["x torch"]) == ("-", "-", "-")
    assert "  torch_compiled: not on the CPU (SmolLM2-135M train f16)" in lines
    assert "  torch: failed: SectionTimeout: over its 1 s limit (Qwen2.5-0.5B decode b8)" in lines


NUMBER = re.compile(r"^-?\d+(\.\d+)?[x%]?$")
OURS = ("ours ms", "GPU ms", "ours tok/s", "base", "attn", "rest", "ours MiB")


QWEN = "Qwen2.5-0.5B"


def lm_rows(lines: list[str]) -> dict:
    """{(model, row): {heading: cell}} of a bench --lm table, every cell a number or -."""
    rows = {(r["model"], r["row"]): r for r in bench_lm.parse_table(lines)}
    for key, r in rows.items():
        for heading, text in list(r.items())[2:]:
            assert text == "-" or NUMBER.match(text), (key, heading, text)
    return rows


@pytest.mark.slow  # about 30 s on lavapipe: a tiny Qwen2, every row, torch on the CPU
def test_lm_quick(tmp_path, capsys, device):
    """bench --lm --quick: every row of the Qwen2 model (q/k/v biases; the Llama model's
    training rows are the two tests below, which took 65 s with these in CI's pass), our
    cells measured, transformers + peft's where they are installed, the same greedy tokens
    on both sides."""
    assert bench.main(["--lm", "--quick", "--lm-models", QWEN, "--out", str(tmp_path)]) == 0
    rows = lm_rows(capsys.readouterr().out.splitlines())
    batches = bench_lm.QUICK.gen_batches
    kinds = ["train f16", "train f32"] + [f"{k} b{b}" for b in batches
                                          for k in ("prefill", "decode")]
    assert list(rows) == [(QWEN, k) for k in kinds]
    f16 = device.has_feature("shader-f16")
    torch_here = not isinstance(bench_lm_torch.modules(), str)
    for (model, kind), r in rows.items():
        # (decode's wall time is a difference of two times: on a busy CPU it may come
        # out - for 3 new tokens)
        ours = OURS if kind.startswith("train") else ("GPU ms", "base", "attn") + \
            (("ours ms", "ours tok/s") if kind.startswith("prefill") else ("ours MiB",))
        if f16 or kind == "train f32":
            assert all(r[h] != "-" for h in ours), (model, kind, r)
        if torch_here and kind.startswith(("train", "prefill")):
            assert r["torch tok/s"] != "-", (model, kind, r)
    with open(tmp_path / f"lm-{COMPILER}-qwen2.5-0.5b.json") as f:
        saved = json.load(f)
    assert [(r["model"], r["row"]) for r in saved["rows"]] == list(rows)
    assert not any(k.startswith("ours") for r in saved["rows"] for k in r["errors"])
    if torch_here and f16:  # the same model in f16 and fp16: the same greedy tokens (a
        # near-tie may differ, and then the rest of its row: measured 100 % on lavapipe)
        same = [r["same_tokens"] for r in saved["rows"] if "same_tokens" in r]
        assert len(same) == len(batches) and max(same) >= 0.5, same


@pytest.mark.slow  # about 15 s on lavapipe
def test_lm_quick_without_torch(tmp_path, monkeypatch, device):
    """Without torch the bench says how to install it and still prints our rows
    (the model made from random weights by numpy)."""
    missing = f"torch, transformers, peft not installed: {bench_lm_torch.INSTALL}"
    monkeypatch.setattr(bench_lm_torch, "modules", lambda: missing)
    lines: list[str] = []
    assert bench_lm.lm_main(str(tmp_path), lines.append, quick=True, models=("SmolLM2-135M",),
                            parts=("train",)) == 0
    assert "pip install torch transformers peft" in lines[0]
    rows = lm_rows(lines)
    assert list(rows) == [("SmolLM2-135M", "train f16"), ("SmolLM2-135M", "train f32")]
    for r in rows.values():
        assert r["torch tok/s"] == "-"
    assert all(rows[("SmolLM2-135M", "train f32")][h] != "-" for h in OURS)
    assert (tmp_path / f"lm-{COMPILER}-smollm2-135m-train.json").is_file()


def test_lm_a_failing_section_is_reported_and_the_run_goes_on(tmp_path, monkeypatch, device):
    """A section that raises leaves its cells empty, its row names the failure, the
    next rows are measured all the same, and the exit code says one of ours failed
    (one model: the two took 17 s beside the slow tier)."""
    monkeypatch.setattr(bench_lm_torch, "modules", lambda: "torch not installed")
    calls = []

    def failing(lm, ids, steps, repeats):
        calls.append(lm.dtype)
        raise RuntimeError("the GPU caught fire\nsecond line")
    monkeypatch.setattr(bench_lm.ours_side, "train_times", failing)
    lines: list[str] = []
    assert bench_lm.lm_main(str(tmp_path), lines.append, quick=True, models=["SmolLM2-135M"],
                            parts=("train",)) == 1
    rows = lm_rows(lines)
    assert len(rows) == 2 and len(calls) == (2 if device.has_feature("shader-f16") else 1)
    assert all(r["ours ms"] == "-" for r in rows.values())
    with open(tmp_path / f"lm-{COMPILER}-smollm2-135m-train.json") as f:
        saved = json.load(f)
    failed = [r for r in saved["rows"] if r["errors"]]
    assert len(failed) == len(calls)
    assert all(r["errors"] == {"ours": "RuntimeError: the GPU caught fire"} for r in failed)
    assert any(line.startswith("  ours: failed: RuntimeError: the GPU caught fire (")
               for line in lines)
