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
from types import SimpleNamespace

import pytest
from helpers import h200_interp

from lora import Strategy
from lora.apps import bench, bench_train
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
    nothing after its warm-up, the baked loop compiles per new count."""
    from lora.apps.bench import main
    assert main(["--tokens-sweep", "--quick", "--forwards", "12", "--baked-forwards", "4",
                 "--out", str(tmp_path)]) == 0
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


def test_gemm_case_in_the_interpreter():
    """``--gemm``'s case on the interpreter device (the H200's matrix shapes and
    workgroup memory): the rule's variant of a linear layer's product runs, is
    checked against float64 before it is timed, and times; a shape is parsed
    as asked."""
    from lora.apps.bench_gemm import ISSUE_SHAPES, gemm_case, parse_shapes, variants

    chosen = variants(64, 48, 32, "linear")[:1]
    row = gemm_case(h200_interp(), (64, 48, 32, "linear"), lambda *a: None, chosen)
    assert len(row["tilings"]) == 1 and not row["refused"]
    for r in row["tilings"].values():
        assert r["us"] > 0 and r["right"] and r["rel_err"] < 2.0**-10
    assert parse_shapes("issue") == ISSUE_SHAPES
    assert parse_shapes("64,4096x576x576") == ((64, 64, 64, "plain"), (4096, 576, 576, "linear"))
    with pytest.raises(ValueError, match="expected 'issue', sizes"):
        parse_shapes("64x64")


def test_gemm_refused_without_matrix_units(tmp_path, capsys, device):
    if device.subgroup_matrix_configs:
        pytest.skip(f"{device.name} has subgroup matrices: the GEMM runs")
    assert bench.main(["--gemm", "64", "--out", str(tmp_path)]) == 1
    assert "has no f16->f32 16x16x16 subgroup matrices" in capsys.readouterr().out


SMALL_CEILINGS = {"mib": 1 / 16, "rows": 32, "cols": 128, "loops": 1, "groups": 2, "gemm": 64}


def test_ceilings_in_the_interpreter(tmp_path):
    """``--ceiling``'s kernels on the interpreter device (the H200's matrix
    shapes): each runs and its output checks against float64 (a copy equal to
    its source, sums equal to their value); the JSON names the robustness."""
    from lora.apps.bench_ceiling import COPY_SHAPES, ceiling_main, robustness_label

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
