"""LoRA adapter files (lora.training.adapter_io): peft's directory and Hesper's binary
file round trip bit for bit, are laid out as peft and Hesper expect, and every
bad file is refused with an AdapterFileError naming the file (and key)."""
from __future__ import annotations

import json
import math
import re
import struct
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from adapter_cases import (
    CASES,
    KEY_A,
    KEY_B,
    AdapterCase,
    bf16_bytes,
    check_outcome,
    config,
    pair_entries,
    raw_safetensors,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from lora.training.adapter_io import (
    CONFIG_NAME,
    HESPER_HEADER,
    REGEX_SECONDS,
    WEIGHTS_NAME,
    AdapterExtrasWarning,
    AdapterFileError,
    LoraLayer,
    adapter_extras,
    load_adapter,
    load_hesper,
    save_adapter,
    save_hesper,
)

ROOT = Path(__file__).resolve().parents[1]
BITS = {np.dtype(np.float32): np.uint32, np.dtype(np.float16): np.uint16}


def random_finite(rng, shape, dtype) -> np.ndarray:
    """Random bit patterns of ``dtype`` (subnormals, -0.0, huge values: all of
    them), with NaN/inf patterns turned finite by clearing an exponent bit."""
    dtype = np.dtype(dtype)
    uint = BITS[dtype]
    bits = rng.integers(0, np.iinfo(uint).max, size=shape, dtype=uint, endpoint=True)
    exponent = np.array(0x7F800000 if uint is np.uint32 else 0x7C00, dtype=uint)
    top = np.array(0x00800000 if uint is np.uint32 else 0x0400, dtype=uint)
    bits = np.where((bits & exponent) == exponent, bits & ~top, bits).astype(uint)
    return bits.view(dtype)


def same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and np.array_equal(
        x.view(BITS[x.dtype]), y.view(BITS[y.dtype]))


def random_layers(rng, shapes, dtype) -> dict:
    """{module: (A, B)} with peft-style module names, one per (rank, in, out)."""
    return {f"model.layers.{i}.self_attn.{'qkvo'[i % 4]}_proj":
            (random_finite(rng, (r, n), dtype), random_finite(rng, (m, r), dtype))
            for i, (r, n, m) in enumerate(shapes)}


def random_hesper(rng, count, rank, dim, kv_dim, dtype=np.float32) -> dict:
    out = {}
    for i in range(count):
        out[f"layers.{i}.q"] = (random_finite(rng, (rank, dim), dtype),
                                random_finite(rng, (dim, rank), dtype))
        out[f"layers.{i}.v"] = (random_finite(rng, (rank, dim), dtype),
                                random_finite(rng, (kv_dim, rank), dtype))
    return out


def assert_round_trip(layers: dict, loaded: dict, dtype) -> None:
    assert sorted(loaded) == sorted(layers)
    for name, (a, b) in layers.items():
        got = loaded[name]
        assert same_bits(got.a.astype(dtype), a) and same_bits(got.b.astype(dtype), b), name


# ---------------------------------------------------------------- round trips

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shapes", [[(1, 1, 1)], [(4, 32, 24)] * 3, [(8, 5, 7), (8, 64, 3)]])
def test_peft_round_trip_is_bit_exact(tmp_path, dtype, shapes):
    layers = random_layers(np.random.default_rng(len(shapes)), shapes, dtype)
    save_adapter(tmp_path / "a", layers, alpha=16)
    loaded = load_adapter(tmp_path / "a")
    for name, (a, b) in layers.items():
        got = loaded[name]
        assert same_bits(got.a, a) and same_bits(got.b, b), name  # dtype kept as stored
        assert (got.rank, got.in_dim, got.out_dim) == (a.shape[0], a.shape[1], b.shape[0])
        assert got.alpha == 16.0 and got.scale == 16.0 / a.shape[0]


def test_peft_float64_is_stored_as_float32(tmp_path):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 3)), rng.standard_normal((4, 2))
    save_adapter(tmp_path, {"m.q_proj": (a, b)}, alpha=2)
    got = load_adapter(tmp_path)["m.q_proj"]
    assert got.a.dtype == np.float32 and np.array_equal(got.a, a.astype(np.float32))
    assert np.array_equal(got.b, b.astype(np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("count, rank, dim, kv_dim", [(1, 1, 1, 1), (2, 4, 32, 8), (3, 8, 16, 16)])
def test_hesper_round_trip_is_bit_exact(tmp_path, dtype, count, rank, dim, kv_dim):
    layers = random_hesper(np.random.default_rng(rank), count, rank, dim, kv_dim, dtype)
    save_hesper(tmp_path / "lora.bin", layers, rank=rank, alpha=12.5)
    loaded = load_hesper(tmp_path / "lora.bin", dim, kv_dim)
    assert_round_trip(layers, loaded, dtype)  # float16 widens to float32 exactly
    assert all(v.a.dtype == np.float32 and v.alpha == 12.5 for v in loaded.values())
    assert loaded["layers.0.v"].out_dim == kv_dim and loaded["layers.0.q"].out_dim == dim


# Names where one is a dotted suffix of another, so that a pattern key of one matches both.
NESTED_NAMES = ["q_proj", "attn.q_proj", "model.attn.q_proj", "v_proj", "x.v_proj", "l.0.q_proj"]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 9), st.integers(1, 9),
                          st.sampled_from([1, 2, 8, 16.5])),
                min_size=1, max_size=len(NESTED_NAMES)),
       st.sampled_from([np.float32, np.float16]), st.booleans(), st.integers(0, 2**32 - 1))
def test_peft_round_trip_property(shapes, dtype, use_rslora, seed):
    """Any ranks and alphas, on names nested in each other: the patterns written give
    each module its own rank and alpha back (and so its scale)."""
    rng = np.random.default_rng(seed)
    names = NESTED_NAMES[:len(shapes)]
    layers = {name: (random_finite(rng, (r, n), dtype), random_finite(rng, (m, r), dtype))
              for name, (r, n, m, _) in zip(names, shapes)}
    alphas = {name: alpha for name, (*_, alpha) in zip(names, shapes)}
    with tempfile.TemporaryDirectory() as d:
        save_adapter(d, layers, alpha=alphas, use_rslora=use_rslora)
        loaded = load_adapter(d)
    assert_round_trip(layers, loaded, dtype)
    for name, layer in loaded.items():
        assert (layer.rank, layer.alpha, layer.use_rslora) == (
            layers[name][0].shape[0], alphas[name], use_rslora), name


def test_mixed_ranks_are_written_as_peft_writes_them(tmp_path):
    """The issue's example: r is the most common rank (the largest on a tie), the others
    in rank_pattern by their escaped names; one alpha for all leaves alpha_pattern empty."""
    rng = np.random.default_rng(0)
    layers = {"q_proj": (rng.standard_normal((8, 4)), rng.standard_normal((4, 8))),
              "v_proj": (rng.standard_normal((4, 4)), rng.standard_normal((4, 4)))}
    save_adapter(tmp_path, layers, alpha=16)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 16.0)
    assert config["rank_pattern"] == {"v_proj": 4} and config["alpha_pattern"] == {}
    got = load_adapter(tmp_path)
    assert (got["q_proj"].scale, got["v_proj"].scale) == (2.0, 4.0)


def test_patterns_keep_their_order_in_the_file(tmp_path):
    """peft takes the first matching key: the longer name must come first in the JSON,
    and a default-rank module that a shorter key would match gets its own key."""
    rng = np.random.default_rng(0)
    shapes = {"a.q_proj": 2, "q_proj": 4, "b.q_proj": 2, "m.a.q_proj": 4}
    layers = {m: (rng.standard_normal((r, 3)), rng.standard_normal((3, r)))
              for m, r in shapes.items()}
    save_adapter(tmp_path, layers, alpha={"a.q_proj": 1, "q_proj": 1, "b.q_proj": 1,
                                          "m.a.q_proj": 3})
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert config["r"] == 4  # two of each: the larger
    assert list(config["rank_pattern"].items()) == [(r"m\.a\.q_proj", 4), (r"a\.q_proj", 2),
                                                    (r"b\.q_proj", 2)]
    assert list(config["alpha_pattern"]) == [r"m\.a\.q_proj"]
    assert {m: layer.rank for m, layer in load_adapter(tmp_path).items()} == shapes


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 3), st.integers(1, 5), st.integers(1, 9), st.integers(1, 9),
       st.integers(0, 2**32 - 1))
def test_hesper_round_trip_property(count, rank, dim, kv_dim, seed):
    layers = random_hesper(np.random.default_rng(seed), count, rank, dim, kv_dim)
    with tempfile.TemporaryDirectory() as d:
        save_hesper(Path(d) / "x.bin", layers, rank=rank, alpha=rank)
        loaded = load_hesper(Path(d) / "x.bin", dim, kv_dim)
    assert_round_trip(layers, loaded, np.float32)


def test_saved_layer_objects_round_trip(tmp_path):
    """save_adapter takes load_adapter's LoraLayers as well as (A, B) pairs."""
    layers = random_layers(np.random.default_rng(2), [(2, 3, 4)], np.float32)
    save_adapter(tmp_path / "one", layers, alpha=4)
    save_adapter(tmp_path / "two", load_adapter(tmp_path / "one"), alpha=4)
    assert_round_trip(layers, load_adapter(tmp_path / "two"), np.float32)


# ---------------------------------------------------------------- the layouts

def test_peft_keys_and_config_are_what_peft_writes(tmp_path):
    rng = np.random.default_rng(3)
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
             "model.layers.1.self_attn.q_proj"]
    layers = {n: (rng.standard_normal((8, 16)), rng.standard_normal((12, 8))) for n in names}
    save_adapter(tmp_path, layers, alpha=16, base_model_name_or_path="meta-llama/Llama-3.2-1B")
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    keys = set(load_file(tmp_path / WEIGHTS_NAME))
    assert keys == {f"base_model.model.{n}.lora_{p}.weight" for n in names for p in "AB"}
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] is None
    assert (config["r"], config["lora_alpha"]) == (8, 16)
    assert config["target_modules"] == ["q_proj", "v_proj"]
    assert config["use_rslora"] is False and config["fan_in_fan_out"] is False
    assert config["base_model_name_or_path"] == "meta-llama/Llama-3.2-1B"
    assert (config["bias"], config["lora_dropout"], config["inference_mode"]) == ("none", 0.0, True)
    assert config["rank_pattern"] == {} and config["alpha_pattern"] == {}
    assert config["modules_to_save"] is None and config["layers_to_transform"] is None


def test_peft_safetensors_metadata_says_pt(tmp_path):
    """transformers' loader wants format=pt in the header, as peft writes it."""
    from safetensors import safe_open
    save_adapter(tmp_path, random_layers(np.random.default_rng(0), [(1, 2, 2)], np.float32),
                 alpha=1)
    with safe_open(str(tmp_path / WEIGHTS_NAME), framework="np") as f:
        assert f.metadata() == {"format": "pt"}


def test_hesper_header_bytes(tmp_path):
    layers = random_hesper(np.random.default_rng(0), 2, 4, 8, 2)
    save_hesper(tmp_path / "x.bin", layers, rank=4, alpha=8.0)
    data = (tmp_path / "x.bin").read_bytes()
    assert data[:4] == bytes([0x41, 0x52, 0x4F, 0x4C])  # 0x4C4F5241 little-endian
    assert struct.unpack("<IIIfII", data[:24]) == (0x4C4F5241, 1, 4, 8.0, 2, 0)
    assert len(data) == 24 + 2 * 4 * (4 * 8 + 8 * 4 + 4 * 8 + 2 * 4)
    q_a = np.frombuffer(data, "<f4", count=32, offset=24).reshape(4, 8)
    assert np.array_equal(q_a, layers["layers.0.q"][0])  # Q_A first, row-major


def test_rslora_scale(tmp_path):
    layers = random_layers(np.random.default_rng(0), [(16, 4, 4)], np.float32)
    save_adapter(tmp_path, layers, alpha=8, use_rslora=True, fan_in_fan_out=True)
    (layer,) = load_adapter(tmp_path).values()
    assert layer.use_rslora and layer.scale == 8 / math.sqrt(16) == 2.0
    assert layer.fan_in_fan_out and layer.a.shape == (16, 4)  # shapes unchanged


def write_peft(path: Path, tensors: dict, **config) -> Path:
    """A peft directory written by hand: the tensors as given, a config of r=2, alpha=4."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / WEIGHTS_NAME)
    (path / CONFIG_NAME).write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                **config}))
    return path


def pair(r, n, m, prefix="base_model.model.", module="model.layers.0.mlp.down_proj",
         infix="") -> dict[str, np.ndarray]:
    return {f"{prefix}{module}.lora_A{infix}.weight": np.ones((r, n), np.float32),
            f"{prefix}{module}.lora_B{infix}.weight": np.ones((m, r), np.float32)}


def test_rank_and_alpha_patterns(tmp_path):
    tensors = {**pair(2, 3, 3, module="model.layers.0.self_attn.q_proj"),
               **pair(4, 3, 3, module="model.layers.1.self_attn.q_proj"),
               **pair(8, 3, 3, module="model.layers.11.self_attn.q_proj")}
    write_peft(tmp_path, tensors, rank_pattern={"layers.1.self_attn.q_proj": 4,
                                                "model.layers.11.self_attn.q_proj": 8},
               alpha_pattern={"layers.11.self_attn.q_proj": 2})
    got = load_adapter(tmp_path)
    ranks = {m.split(".")[2]: (ly.rank, ly.alpha, ly.scale) for m, ly in got.items()}
    assert ranks == {"0": (2, 4.0, 2.0), "1": (4, 4.0, 1.0), "11": (8, 2.0, 0.25)}


def test_keys_without_prefix_or_with_default_infix(tmp_path):
    write_peft(tmp_path / "bare", pair(2, 3, 5, prefix=""))
    write_peft(tmp_path / "infix", pair(2, 3, 5, infix=".default"))
    for d in ("bare", "infix"):
        (name,) = load_adapter(tmp_path / d)
        assert name == "model.layers.0.mlp.down_proj"


def test_target_modules_regex_and_suffix(tmp_path):
    write_peft(tmp_path / "re", pair(2, 3, 3), target_modules=r".*\.mlp\.down_proj")
    write_peft(tmp_path / "suffix", pair(2, 3, 3), target_modules=["mlp.down_proj"])
    assert load_adapter(tmp_path / "re") and load_adapter(tmp_path / "suffix")


def test_save_writes_nothing_half_done(tmp_path, monkeypatch):
    """A failure while writing leaves the previous adapter intact and no temp files."""
    import lora.training.adapter_io as io
    layers = random_layers(np.random.default_rng(0), [(2, 3, 4)], np.float32)
    save_adapter(tmp_path, layers, alpha=2)

    def broken(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise OSError("disk full")
    monkeypatch.setattr(io, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_adapter(tmp_path, random_layers(np.random.default_rng(9), [(2, 3, 4)], np.float32),
                     alpha=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    assert_round_trip(layers, load_adapter(tmp_path), np.float32)


def test_imports_without_wgpu():
    probe = ("import sys; sys.modules['wgpu'] = None\n"
             "import lora.training.adapter_io as io; print(io.LoraLayer.__name__)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["LoraLayer"]


# ---------------------------------------------------------------- bad peft files

def refused(path, *, match: str, naming: Path) -> str:
    """load_adapter(path) raises AdapterFileError whose message names ``naming``."""
    with pytest.raises(AdapterFileError, match=match) as info:
        load_adapter(path)
    assert str(naming) in str(info.value), str(info.value)
    return str(info.value)


def test_missing_directory(tmp_path):
    refused(tmp_path / "nope", match="no such adapter directory", naming=tmp_path / "nope")


def test_the_tensors_file_instead_of_its_directory(tmp_path):
    write_peft(tmp_path, pair(2, 3, 3))
    refused(tmp_path / WEIGHTS_NAME, match=r"load_adapter takes the adapter's directory \(with "
            r"adapter_config.json beside adapter_model.safetensors\), not the tensors file: "
            r"load_adapter\(", naming=tmp_path)
    (tmp_path / "notes.txt").write_text("")
    refused(tmp_path / "notes.txt", match=r"no such adapter directory \(a file: load_adapter "
            r"takes the adapter's directory\)", naming=tmp_path / "notes.txt")


def test_a_folder_of_several_adapters_names_them(tmp_path):
    """peft's save_pretrained of several adapters writes each (but "default")
    in a folder of its name; loading the folder above says which to load."""
    for name in ("support", "legal"):
        write_peft(tmp_path / name, pair(2, 3, 3))
    (tmp_path / "README.md").write_text("")
    refused(tmp_path, match=r"missing; a peft adapter directory holds adapter_config.json and "
            r"adapter_model.safetensors; .* holds the adapters \['legal', 'support'\] in folders "
            r"of their names \(peft's save_pretrained of several adapters\): load_adapter\(",
            naming=tmp_path / "legal")


@pytest.mark.parametrize("gone", [CONFIG_NAME, WEIGHTS_NAME])
def test_missing_file(tmp_path, gone):
    write_peft(tmp_path, pair(2, 3, 3))
    (tmp_path / gone).unlink()
    refused(tmp_path, match="missing", naming=tmp_path / gone)


def test_config_not_json(tmp_path):
    write_peft(tmp_path, pair(2, 3, 3))
    (tmp_path / CONFIG_NAME).write_text('{"r": 2, "lora_alpha": ')
    refused(tmp_path, match="not valid JSON", naming=tmp_path / CONFIG_NAME)


@pytest.mark.parametrize("field", ["r", "lora_alpha"])
def test_config_missing_field(tmp_path, field):
    write_peft(tmp_path, pair(2, 3, 3))
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    del config[field]
    (tmp_path / CONFIG_NAME).write_text(json.dumps(config))
    refused(tmp_path, match=f"missing '{field}'", naming=tmp_path / CONFIG_NAME)


@pytest.mark.parametrize("cut", ["half", "garbage"])
def test_corrupt_safetensors(tmp_path, cut):
    write_peft(tmp_path, pair(2, 3, 3))
    file = tmp_path / WEIGHTS_NAME
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2] if cut == "half" else b"not a safetensors file")
    refused(tmp_path, match="not a readable safetensors file", naming=file)


@pytest.mark.parametrize("part, other", [("A", "B"), ("B", "A")])
def test_unpaired_tensor(tmp_path, part, other):
    tensors = pair(2, 3, 3)
    key = f"base_model.model.model.layers.0.mlp.down_proj.lora_{other}.weight"
    del tensors[key]
    write_peft(tmp_path, tensors)
    msg = refused(tmp_path, match=f"but no lora_{other} tensor", naming=tmp_path / WEIGHTS_NAME)
    assert "model.layers.0.mlp.down_proj" in msg


@pytest.mark.parametrize("a_shape, b_shape, key", [
    ((3, 4), (4, 2), "lora_A"),   # A rows != r
    ((2, 4), (4, 3), "lora_B"),   # B columns != r
    ((4,), (4, 2), "lora_A")])    # A 1-D
def test_wrong_shapes(tmp_path, a_shape, b_shape, key):
    m = "base_model.model.x.q_proj"
    write_peft(tmp_path, {f"{m}.lora_A.weight": np.ones(a_shape, np.float32),
                          f"{m}.lora_B.weight": np.ones(b_shape, np.float32)})
    msg = refused(tmp_path, match=f"{key} must be", naming=tmp_path / WEIGHTS_NAME)
    assert f"{m}.{key}.weight" in msg


def write_raw_safetensors(file: Path, tensors: dict[str, tuple[str, tuple, bytes]]) -> None:
    """A safetensors file by hand (numpy has no bfloat16): u64 header length, JSON, data."""
    header, data = {}, b""
    for key, (dtype, shape, raw) in tensors.items():
        header[key] = {"dtype": dtype, "shape": list(shape),
                       "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("dtype, size", [("I32", 4), ("I64", 8)])
def test_unknown_dtype(tmp_path, dtype, size):
    write_peft(tmp_path, {})
    key = "base_model.model.x.q_proj.lora_A.weight"
    write_raw_safetensors(tmp_path / WEIGHTS_NAME, {
        key: (dtype, (2, 3), bytes(6 * size)),
        "base_model.model.x.q_proj.lora_B.weight": ("F32", (3, 2), bytes(24))})
    msg = refused(tmp_path, match=f"dtype {dtype}", naming=tmp_path / WEIGHTS_NAME)
    assert key in msg and "F32, F16, BF16 or F64 expected" in msg


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_values(tmp_path, bad):
    tensors = pair(2, 3, 3)
    key = "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
    tensors[key][0, :2] = bad
    write_peft(tmp_path, tensors)
    msg = refused(tmp_path, match="2 of 6 values are NaN or infinite",
                  naming=tmp_path / WEIGHTS_NAME)
    assert key in msg


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], r".*\.q_proj"])
def test_module_not_in_target_modules(tmp_path, targets):
    write_peft(tmp_path, pair(2, 3, 3), target_modules=targets)
    msg = refused(tmp_path, match="does not match target_modules", naming=tmp_path / WEIGHTS_NAME)
    assert "model.layers.0.mlp.down_proj" in msg


# A module named by 28 a's and "!": against "(a+)+", Python's re takes seconds, doubling
# per letter; the regex module answers at once, and a time limit stops what it cannot.
HOSTILE_MODULE = "a" * 28 + "!"


def config_with_regex(field: str, pattern: str) -> dict:
    return ({"target_modules": pattern} if field == "target_modules"
            else {"rank_pattern": {pattern: 2}})


@pytest.mark.parametrize("field", ["target_modules", "rank_pattern"])
def test_nested_repetition_is_matched_at_once(tmp_path, field):
    write_peft(tmp_path, pair(2, 3, 3, module=HOSTILE_MODULE), **config_with_regex(
        field, "(a+)+"))
    start = time.perf_counter()
    if field == "target_modules":
        refused(tmp_path, match="does not match target_modules", naming=tmp_path / WEIGHTS_NAME)
    else:
        assert load_adapter(tmp_path)[HOSTILE_MODULE].rank == 2  # no match: r is the default
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("field", ["target_modules", "rank_pattern"])
def test_backtracking_regex_is_refused_in_bounded_time(tmp_path, field):
    write_peft(tmp_path, pair(2, 3, 3, module=HOSTILE_MODULE), **config_with_regex(
        field, "(a|a)+"))
    start = time.perf_counter()
    msg = refused(tmp_path, match=r"'\(a\|a\)\+' took over .* \(catastrophic backtracking",
                  naming=tmp_path / WEIGHTS_NAME)
    assert field in msg and time.perf_counter() - start < 10 * REGEX_SECONDS + 1


def test_config_nested_too_deeply(tmp_path):
    write_peft(tmp_path, pair(2, 3, 3))
    (tmp_path / CONFIG_NAME).write_text('{"r": 2, "lora_alpha": 4, "x": ' + "[" * 100_000
                                        + "]" * 100_000 + "}")
    refused(tmp_path, match="nested too deeply", naming=tmp_path / CONFIG_NAME)


def test_config_rank_of_5000_digits(tmp_path):
    write_peft(tmp_path, pair(2, 3, 3))
    (tmp_path / CONFIG_NAME).write_text('{"r": ' + "9" * 5000 + ', "lora_alpha": 4}')
    refused(tmp_path, match="not valid JSON .*digits", naming=tmp_path / CONFIG_NAME)


def test_safetensors_duplicate_keys(tmp_path):
    write_peft(tmp_path, pair(2, 3, 3))
    file = tmp_path / WEIGHTS_NAME
    data = file.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    key = sorted(k for k in header if k.endswith("lora_A.weight"))[0]
    entry = json.dumps(header[key])
    text = json.dumps(header)[:-1] + f", {json.dumps(key)}: {entry}}}"
    text += " " * (-len(text) % 8)
    file.write_bytes(len(text).to_bytes(8, "little") + text.encode() + data[8 + length:])
    msg = refused(tmp_path, match="names .* twice", naming=file)
    assert key in msg


# ---------------------------------------------------------------- the table both readers share

def python_outcome(folder: Path, case: AdapterCase) -> dict:
    """load_adapter's reading of ``case`` as {"layers": ...} or {"refused": message}."""
    folder.mkdir()
    (folder / CONFIG_NAME).write_text(case.config)
    (folder / WEIGHTS_NAME).write_bytes(case.tensors)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AdapterExtrasWarning)
            layers = load_adapter(folder)
    except AdapterFileError as e:
        return {"refused": str(e)}
    return {"layers": {module: [layer.rank, layer.in_dim, layer.out_dim, layer.scale]
                       for module, layer in layers.items()},
            "values": {module: [layer.a.astype(np.float32).ravel().tolist(),
                                layer.b.astype(np.float32).ravel().tolist()]
                       for module, layer in layers.items()}}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_shared_adapter_cases(tmp_path, case):
    """tests/adapter_cases.py, which the page's reader passes too (tests/test_adapter_js.py)."""
    check_outcome(case, python_outcome(tmp_path / "adapter", case), "Python")


def test_reserved_names_are_refused_when_saving(tmp_path):
    with pytest.raises(AdapterFileError, match="holds the name 'constructor'"):
        save_adapter(tmp_path / "a", {"model.constructor": (np.ones((1, 2)), np.ones((2, 1)))},
                     alpha=1)
    assert not (tmp_path / "a").exists()


# ---------------------------------------------------------------- bad Hesper files

def hesper_file(tmp_path, **header) -> tuple[Path, bytearray]:
    """A valid 1-layer rank-2 Hesper file (dim 4, kv_dim 2), header fields overridable."""
    fields = {"magic": 0x4C4F5241, "version": 1, "rank": 2, "alpha": 4.0, "layers": 1,
              "reserved": 0, **header}
    body = np.arange(2 * 4 + 4 * 2 + 2 * 4 + 2 * 2, dtype="<f4").tobytes()
    return tmp_path / "lora.bin", bytearray(HESPER_HEADER.pack(*fields.values()) + body)


def hesper_refused(path: Path, data: bytes | bytearray, match: str) -> str:
    path.write_bytes(bytes(data))
    with pytest.raises(AdapterFileError, match=match) as info:
        load_hesper(path, 4, 2)
    assert str(path) in str(info.value)
    return str(info.value)


def test_hesper_valid_file_loads(tmp_path):
    path, data = hesper_file(tmp_path)
    path.write_bytes(bytes(data))
    got = load_hesper(path, 4, 2)
    assert got["layers.0.v"].b.shape == (2, 2) and got["layers.0.q"].scale == 2.0
    assert np.array_equal(got["layers.0.q"].b.ravel(), np.arange(8, 16))


def test_hesper_wrong_magic(tmp_path):
    path, data = hesper_file(tmp_path, magic=0x41524F4C)  # "LORA" written big-endian
    hesper_refused(path, data, "magic 0x41524F4C, not Hesper's 0x4C4F5241")


def test_hesper_wrong_version(tmp_path):
    path, data = hesper_file(tmp_path, version=2)
    hesper_refused(path, data, "version 2; only version 1")


@pytest.mark.parametrize("keep", [10, 24 + 40])
def test_hesper_truncated(tmp_path, keep):
    path, data = hesper_file(tmp_path)
    hesper_refused(path, data[:keep], "shorter than the 24-byte" if keep < 24 else "truncated")


def test_hesper_trailing_bytes(tmp_path):
    path, data = hesper_file(tmp_path)
    hesper_refused(path, data + b"\0" * 8, "8 extra bytes")


def test_hesper_wrong_dims_read_as_size_mismatch(tmp_path):
    path, data = hesper_file(tmp_path)
    path.write_bytes(bytes(data))
    with pytest.raises(AdapterFileError, match="truncated"):
        load_hesper(path, 5, 2)


def test_hesper_nan(tmp_path):
    path, data = hesper_file(tmp_path)
    data[24 + 4 * 17: 24 + 4 * 18] = struct.pack("<f", float("nan"))  # V_A's second value
    msg = hesper_refused(path, data, "1 of 8 values are NaN or infinite")
    assert "layers.0.v.lora_A" in msg


def test_hesper_size_is_checked_before_reading(tmp_path):
    """A 3 GiB file (sparse: no disk used) whose header says 1 layer: refused from its
    size, without reading the 3 GiB (the test runs under a 1 GiB address-space budget
    of the data read, measured by the time it takes)."""
    path, data = hesper_file(tmp_path)
    with open(path, "wb") as f:
        f.write(bytes(data))
        f.truncate(3 << 30)
    start = time.perf_counter()
    with pytest.raises(AdapterFileError, match="extra bytes"):
        load_hesper(path, 4, 2)
    assert time.perf_counter() - start < 1.0


def test_hesper_missing_file(tmp_path):
    with pytest.raises(AdapterFileError, match="no such Hesper LoRA file"):
        load_hesper(tmp_path / "none.bin", 4, 2)


# ---------------------------------------------------------------- refusing to save

@pytest.mark.parametrize("a, b, match", [
    (np.ones((2, 3)), np.ones((4, 3)), "same r"),
    (np.ones(3), np.ones((4, 1)), "same r"),
    (np.array([[1.0, np.nan]]), np.ones((2, 1)), "1 of 2 values are NaN"),
    (np.array([[1e300]]), np.ones((1, 1)), "NaN or infinite"),   # inf once cast to float32
    (np.ones((1, 2), np.int32), np.ones((2, 1)), "dtype int32 is not a real float")])
def test_save_adapter_refuses_before_writing(tmp_path, a, b, match):
    target = tmp_path / "adapter"
    with pytest.raises(AdapterFileError, match=match) as info:
        save_adapter(target, {"ok.q_proj": (np.ones((1, 2)), np.ones((2, 1))), "x.v_proj": (a, b)},
                     alpha=1)
    assert str(target) in str(info.value) and "x.v_proj" in str(info.value)
    assert not target.exists()


def test_save_adapter_refuses_foreign_targets_and_bad_alphas(tmp_path):
    layers = random_layers(np.random.default_rng(0), [(2, 3, 3), (4, 3, 3)], np.float32)
    with pytest.raises(AdapterFileError, match="does not match target_modules"):
        save_adapter(tmp_path / "a", dict(list(layers.items())[:1]), alpha=1,
                     target_modules=["v_proj"])
    first = next(iter(layers))
    with pytest.raises(AdapterFileError, match=re.escape(
            "alpha as a dict must name every module of layers and no other; missing "
            "['model.layers.1.self_attn.k_proj'], extra ['x']")):
        save_adapter(tmp_path / "a", layers, alpha={first: 1, "x": 2})
    with pytest.raises(AdapterFileError, match=re.escape(
            f"alpha['{first}'] must be a finite number, got nan")):
        save_adapter(tmp_path / "a", layers, alpha={m: math.nan for m in layers})
    assert not (tmp_path / "a").exists()


def test_save_adapter_writes_lora_dropout(tmp_path):
    """The config's lora_dropout is the argument (0.0 by default), which peft
    applies when it trains the adapter on; one outside [0, 1) writes nothing."""
    layers = random_layers(np.random.default_rng(0), [(2, 3, 3)], np.float32)
    config = json.loads((save_adapter(tmp_path / "a", layers, alpha=4, lora_dropout=0.1)
                         / CONFIG_NAME).read_text())
    assert config["lora_dropout"] == 0.1
    assert json.loads((save_adapter(tmp_path / "b", layers, alpha=4) / CONFIG_NAME)
                      .read_text())["lora_dropout"] == 0.0
    with pytest.raises(AdapterFileError, match=r"lora_dropout must be a probability in "
                                               r"\[0, 1\), got 1.0"):
        save_adapter(tmp_path / "c", layers, alpha=4, lora_dropout=1.0)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.pop("layers.0.v"), re.escape("layers.{i}.q and layers.{i}.v")),
    (lambda d: d.update({"layers.2.q": d["layers.0.q"]}), re.escape("and nothing else")),
    (lambda d: d.update({"layers.1.v": (np.ones((2, 4)), np.ones((3, 2)))}),
     re.escape("needs A (2, 4) and B (2, 2)"))])
def test_save_hesper_refuses_other_layouts(tmp_path, mutate, match):
    layers = random_hesper(np.random.default_rng(0), 2, 2, 4, 2)
    mutate(layers)
    with pytest.raises(AdapterFileError, match=match):
        save_hesper(tmp_path / "x.bin", layers, rank=2, alpha=1)
    assert not (tmp_path / "x.bin").exists()


# ---------------------------------------------------------------- the docs

def test_docs_error_table_names_real_tests():
    text = (ROOT / "docs" / "adapter-files.md").read_text()
    named = set(re.findall(r"`(test_[a-z0-9_]+)", text))
    assert named and named <= set(globals()), sorted(named - set(globals()))


def test_layer_checks_its_shapes():
    with pytest.raises(ValueError, match="A must be"):
        LoraLayer(np.ones((2, 3)), np.ones((3, 3)), alpha=1.0)


def test_tensors_beside_the_lora_pairs_are_left_out_with_a_warning(tmp_path):
    """A SEQ_CLS adapter's modules_to_save head and bias="lora_only" biases:
    the LoRA pairs load, a warning names what is not applied, adapter_extras
    returns it; a LoRA tensor of another kind (DoRA) is still refused."""
    tensors = pair(2, 3, 5)
    head = np.arange(6, dtype=np.float32).reshape(2, 3)
    bias = np.ones(5, np.float32)
    tensors["base_model.model.classifier.modules_to_save.default.weight"] = head
    tensors["base_model.model.model.layers.0.mlp.down_proj.bias"] = bias
    write_peft(tmp_path, tensors, modules_to_save=["classifier"], bias="lora_only")
    with pytest.warns(AdapterExtrasWarning, match=r"2 tensor\(s\) beside the LoRA pairs are not "
                                                  r"applied: base_model.model.classifier.modules_"
                                                  r"to_save.default.weight, base_model.model.model"
                                                  r".layers.0.mlp.down_proj.bias \(modules_to_save="
                                                  r"\['classifier'\], bias='lora_only'\)"):
        layers = load_adapter(tmp_path)
    assert list(layers) == ["model.layers.0.mlp.down_proj"]
    extras = adapter_extras(tmp_path)
    assert set(extras) == {"classifier.modules_to_save.default.weight",
                           "model.layers.0.mlp.down_proj.bias"}
    np.testing.assert_array_equal(extras["classifier.modules_to_save.default.weight"], head)
    tensors["base_model.model.model.layers.0.mlp.down_proj.lora_magnitude_vector"] = bias
    write_peft(tmp_path, tensors)
    refused(tmp_path, match=r"unexpected key .*lora_magnitude_vector; only <module>.lora_A.weight "
                            r"and <module>.lora_B.weight are supported \(not DoRA's magnitudes",
            naming=tmp_path)


# ---------------------------------------------------------------- stored dtypes

def write_case(folder: Path, name: str) -> Path:
    """The shared case ``name``'s two files in ``folder``."""
    case = next(c for c in CASES if c.name == name)
    folder.mkdir()
    (folder / CONFIG_NAME).write_text(case.config)
    (folder / WEIGHTS_NAME).write_bytes(case.tensors)
    return folder


def test_bfloat16_widens_to_float32_exactly(tmp_path):
    """Every bfloat16 bit pattern but NaN and inf reads as the float32 with those top bits."""
    bits = np.arange(0x10000, dtype=np.uint32)
    values = (bits << 16).view(np.float32)
    values = values[np.isfinite(values)].reshape(1, -1)
    (key_a, _, _, _), b = pair_entries(rank=1)[0], pair_entries(rank=1)[1]
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / CONFIG_NAME).write_text(config(r=1))
    (folder / WEIGHTS_NAME).write_bytes(raw_safetensors(
        [(key_a, "BF16", list(values.shape), bf16_bytes(values)), b]))
    (layer,) = load_adapter(folder).values()
    assert same_bits(layer.a, values)


@pytest.mark.parametrize("name, value, beyond", [("BF16", 2.0 ** 100, "1 of 6"),
                                                 ("F64", float(np.finfo(np.float32).max),
                                                  "2 of 10")])
def test_float16_is_refused_where_a_value_does_not_fit(tmp_path, name, value, beyond):
    """dtype=float16 rounds every tensor to float16: a value beyond its 65504 (bfloat16
    has float32's range) is refused, naming the first, rather than made infinite."""
    folder = write_case(tmp_path / "a", name)
    key = KEY_A if name == "BF16" else KEY_B
    with pytest.raises(AdapterFileError, match=re.escape(
            f"{folder / WEIGHTS_NAME}: {key} holds {value!r}, which does not fit float16 "
            f"(largest finite 65504.0); {beyond} values are beyond it")):
        load_adapter(folder, dtype=np.float16)


@pytest.mark.parametrize("name, dtype", [("good f32", "float16"), ("good f16", np.float32),
                                         ("BF16", None), ("F64", None), ("good f16", None)])
def test_dtype_of_what_is_loaded(tmp_path, name, dtype):
    """F32 and F16 as stored, BF16 and F64 as float32, or every tensor as ``dtype``."""
    folder = write_case(tmp_path / "a", name)
    (layer,) = load_adapter(folder, dtype=dtype).values()
    want = np.dtype(dtype or (np.float16 if name == "good f16" else np.float32))
    assert layer.a.dtype == layer.b.dtype == want
    with safe_open(str(folder / WEIGHTS_NAME), framework="np") as f:
        stored = {f.get_slice(k).get_dtype() for k in f.keys()}
    if stored <= {"F32", "F16"}:  # read by safetensors, then rounded by numpy
        assert np.array_equal(layer.a, load_file(folder / WEIGHTS_NAME)[KEY_A].astype(want))


@pytest.mark.parametrize("dtype", ["bfloat16", np.float64, int, "x"])
def test_load_dtype_must_be_float32_or_float16(tmp_path, dtype):
    with pytest.raises(AdapterFileError, match=re.escape(
            f"load_adapter: dtype {dtype!r}; None (as stored), float32 or float16 expected")):
        load_adapter(write_case(tmp_path / "a", "good f32"), dtype=dtype)
