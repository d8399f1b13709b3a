"""The host side of loading a causal LM (lora.models): a config.json read as transformers
reads it, the rotary tables transformers computes, a Hugging Face folder read with no
torch (every bad folder refused naming the file and the tensor), a transformers or peft
model's weights and adapter, peft's target_modules, and a language model's adapter
files through real peft.

The folders here are written by hand (numpy and safetensors) unless the test compares
with transformers; those tests need torch, transformers and peft, and skip without
them, saying why (scripts/setup.sh installs them with the torch extra where it can)."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from adapter_cases import bf16_bytes, raw_safetensors
from safetensors.numpy import save_file

from lora.models.adapters import peft_adapter
from lora.models.checks import ModelError
from lora.models.config import (
    DEFAULTS,
    LMConfig,
    WeightSplit,
    linear_modules,
    memory_check,
    weight_shapes,
)
from lora.models.rope import SUPPORTED_ROPE, rope_inv_freq, rope_tables
from lora.models.targets import lm_modules, resolve_targets
from lora.models.weights import (
    INDEX_NAME,
    LMWeights,
    load_weights,
    read_config,
    weights_from_transformers,
)
from lora.training.adapter_io import AdapterFileError, load_adapter, save_adapter

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
QWEN = {**TINY, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
STORED = {"F32": np.float32, "F16": np.float16}
# The config.json of models in SmolLM2-135M's and Qwen2.5-0.5B's shapes, as their files
# spell them (transformers 4's keys: torch_dtype, rope_theta, rope_scaling)
SMOLLM2_135M = {"_name_or_path": "smollm2-135m-shape", "architectures": ["LlamaForCausalLM"],
                "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
                "eos_token_id": 0, "head_dim": 64, "hidden_act": "silu", "hidden_size": 576,
                "intermediate_size": 1536, "max_position_embeddings": 8192, "mlp_bias": False,
                "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
                "num_key_value_heads": 3, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
                "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000,
                "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 49152}
QWEN25_05B = {"_name_or_path": "qwen2.5-0.5b-shape", "architectures": ["Qwen2ForCausalLM"],
              "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
              "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864,
              "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
              "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
              "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
              "use_sliding_window": False, "vocab_size": 151936}
WEBGPU_DEFAULTS = {"max-buffer-size": 268435456, "max-storage-buffer-binding-size": 134217728}


def needs_torch():
    """torch, transformers and peft, or a skip saying why."""
    reason = "needs torch, transformers and peft (the torch extra: pip install -e '.[torch]')"
    torch = pytest.importorskip("torch", reason=reason)
    pytest.importorskip("transformers", reason=reason)
    pytest.importorskip("peft", reason=reason)
    return torch


def random_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 values (bfloat16 ones: their low 16 bits zero) for every weight ``config``
    implies."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_shapes(LMConfig.from_dict(config)).items():
        values = rng.standard_normal(shape).astype(np.float32) * 0.05
        out[name] = (values.view(np.uint32) & 0xFFFF0000).view(np.float32)
    return out


def write_file(path: Path, tensors: dict[str, np.ndarray], stored: str = "F32") -> None:
    """``tensors`` as one safetensors file, stored as F32, F16 or BF16."""
    if stored == "BF16":
        entries = [(k, "BF16", list(v.shape), bf16_bytes(v)) for k, v in tensors.items()]
        path.write_bytes(raw_safetensors(entries))
    else:
        save_file({k: v.astype(STORED[stored]) for k, v in tensors.items()}, str(path),
                  metadata={"format": "pt"})


def write_folder(path: Path, config: dict, tensors: dict, stored: str = "F32",
                 shards: int = 0) -> Path:
    """A model folder: config.json, and model.safetensors (or ``shards`` shards and
    their index), as transformers' save_pretrained lays them out."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if not shards:
        write_file(path / "model.safetensors", tensors, stored)
        return path
    names, weight_map = list(tensors), {}
    for k in range(shards):
        part = names[k::shards]
        shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        write_file(path / shard, {n: tensors[n] for n in part}, stored)
        weight_map.update({n: shard for n in part})
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


# ---------------------------------------------------------------- config.json

def test_defaults_are_transformers_own_for_what_a_config_leaves_out():
    llama = LMConfig.from_dict({"model_type": "llama"})
    assert (llama.vocab_size, llama.num_key_value_heads, llama.head_dim, llama.qkv_bias,
            llama.o_bias, llama.bos_token_id, llama.eos_token_ids) == (32000, 32, 128, False,
                                                                       False, 1, (2,))
    qwen = LMConfig.from_dict({"model_type": "qwen2"})
    assert (qwen.vocab_size, qwen.max_position_embeddings, qwen.qkv_bias, qwen.o_bias,
            qwen.mlp_bias, qwen.bos_token_id, qwen.eos_token_ids) == (151936, 32768, True,
                                                                      False, False, None, ())
    # Qwen2's kv heads default to 32 whatever the heads: 8 heads cannot share 32
    with pytest.raises(ModelError, match="num_attention_heads 8 is not a multiple of "
                                         "num_key_value_heads 32"):
        LMConfig.from_dict({"model_type": "qwen2", "num_attention_heads": 8,
                            "hidden_size": 64})
    assert llama.rope.theta == 10000.0 and llama.rope.rope_type == "default"
    assert DEFAULTS["llama"]["max_position_embeddings"] == llama.max_position_embeddings


@pytest.mark.parametrize("extra", [
    {}, {"model_type": "qwen2"}, {"attention_bias": True, "mlp_bias": True},
    {"head_dim": 32}, {"num_key_value_heads": None}, {"tie_word_embeddings": True},
    {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192}},
    {"rope_scaling": {"type": "linear", "factor": 2.0}},
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                         "original_max_position_embeddings": 4096}},
    {"eos_token_id": [1, 2], "bos_token_id": None, "pad_token_id": 0, "torch_dtype": "bfloat16"},
    {"model_type": "qwen2", "head_dim": 32, "hidden_size": 96, "use_sliding_window": False,
     "sliding_window": 32768, "max_window_layers": 21, "rope_scaling": None},
    SMOLLM2_135M, QWEN25_05B,
], ids=lambda e: e.get("_name_or_path") or ",".join(e) or "plain")
def test_a_config_json_reads_as_transformers_reads_it(extra):
    """from_dict of a config.json's dict equals from_transformers of the config
    transformers makes of it (its defaults, biases, head_dim, rope standardisation)."""
    needs_torch()
    from transformers import AutoConfig

    d = {**(QWEN if extra.get("model_type") == "qwen2" else TINY), **extra}
    ours = LMConfig.from_dict(d)
    theirs = LMConfig.from_transformers(AutoConfig.for_model(**d))
    assert ours == theirs


CONFIG_REFUSALS = [
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported; lora runs 'llama' "
                                "(LlamaForCausalLM), 'qwen2' (Qwen2ForCausalLM)"),
    ({"architectures": ["LlamaForSequenceClassification"]},
     "lora runs LlamaForCausalLM for model_type 'llama'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported; lora runs 'silu'"),
    ({"hidden_size": "64"}, "hidden_size must be an integer from 1 to 2147483647, got '64', "
                            "a string"),
    ({"hidden_size": 64.0}, "hidden_size must be an integer from 1 to 2147483647, got 64.0, "
                            "a number"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer from 1 to 1024, got "
                                  "True, a boolean"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be an integer from 1 to 1024, got 0"),
    ({"hidden_size": 66}, "hidden_size 66 is not a multiple of num_attention_heads 4"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of "
                                 "num_key_value_heads 3"),
    ({"head_dim": 15}, "head_dim 15 is odd"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got "
                                       "'false', a string"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a finite number >= 0.0, got '1e-6'"),
    ({"eos_token_id": [2, "3"]}, "eos_token_id must be an integer from 0 to 2147483647, got "
                                 "'3', a string"),
    ({"attention_dropout": 1.0}, "attention_dropout must be in [0, 1), got 1.0"),
    ({"quantization_config": {"quant_method": "gptq"}},
     "quantization_config ('gptq'): quantized weights are not supported"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type 'dynamic' is not supported; lora computes ('default', "
     "'linear', 'llama3', 'yarn'), static tables ('dynamic' rescales"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0]}},
     "rope_parameters.rope_type 'longrope' is not supported"),
    ({"rope_theta": "10000"}, "rope_theta must be a finite number > 0, got '10000', a string"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5: lora rotates the whole head"),
    ({"rope_scaling": {"type": "linear"}}, "rope_scaling: factor is missing"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                       "high_freq_factor": 1.0}},
     "high_freq_factor (1.0) must be greater than low_freq_factor (4.0)"),
    ({"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 1024}},
     "rope_parameters: factor is missing"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
      "sliding_window": 16, "max_window_layers": 1},
     "use_sliding_window is true: layer 1 attends only to the last 16 tokens"),
]


@pytest.mark.parametrize("extra, message", CONFIG_REFUSALS,
                         ids=[str(list(e.items())[-1])[:40] for e, _ in CONFIG_REFUSALS])
def test_bad_configs_are_refused_by_key(extra, message):
    with pytest.raises(ModelError, match=re.escape(message)) as info:
        LMConfig.from_dict({**TINY, **extra}, source="m/config.json")
    assert str(info.value).startswith("m/config.json: ")


def test_what_a_config_may_say_that_changes_nothing():
    # a sliding window no layer uses, and one longer than every sequence
    for extra in ({"use_sliding_window": True, "max_window_layers": 28},
                  {"use_sliding_window": True, "sliding_window": 32768, "max_window_layers": 0}):
        assert LMConfig.from_dict({**QWEN, **extra}).model_type == "qwen2"
    with pytest.warns(UserWarning, match="attention_dropout 0.1 is not applied"):
        assert LMConfig.from_dict({**TINY, "attention_dropout": 0.1}).attention_dropout == 0.1
    with pytest.raises(ModelError, match="expected a JSON object, got a list"):
        LMConfig.from_dict([TINY])  # pyright: ignore[reportArgumentType]


def test_shapes_and_linear_modules_are_the_models():
    """weight_shapes and lm_modules name exactly transformers' state_dict and modules."""
    torch = needs_torch()
    from transformers import AutoConfig, AutoModelForCausalLM

    for d in (TINY, {**QWEN, "tie_word_embeddings": True},
              {**TINY, "attention_bias": True, "mlp_bias": True, "head_dim": 32}):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**d))
        config = LMConfig.from_transformers(model.config)
        state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if config.tie_word_embeddings:
            del state["lm_head.weight"]
        assert weight_shapes(config) == state and list(weight_shapes(config)) == list(state)
        kinds = {n: type(m).__name__ for n, m in model.named_modules() if n}
        assert lm_modules(config) == kinds and list(lm_modules(config)) == list(kinds)
        assert {n: (m.out_features, m.in_features, m.bias is not None)
                for n, m in model.named_modules() if type(m).__name__ == "Linear"} == \
            linear_modules(config)


# ---------------------------------------------------------------- rotary tables

def ulps(ours: np.ndarray, theirs: np.ndarray) -> float:
    """The largest difference in units of the last place of the larger of each pair."""
    big = np.maximum(np.abs(ours), np.abs(theirs)).astype(np.float32)
    return float(np.max(np.abs(ours.astype(np.float64) - theirs) / np.spacing(big)))


ROPES = {  # real models' settings, with head_dim as in them
    "tiny": (16, {}),
    "llama3.2-1B": (64, {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, "max_position_embeddings": 131072}),
    "llama3.1-8B": (128, {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, "max_position_embeddings": 131072}),
    "qwen2.5-0.5B": (64, {"model_type": "qwen2", "rope_theta": 1000000.0}),
    "smollm2": (64, {"rope_theta": 100000.0}),
    "linear": (64, {"rope_scaling": {"type": "linear", "factor": 4.0}}),
    "yarn": (64, {"model_type": "qwen2", "rope_theta": 1000000.0, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        "max_position_embeddings": 131072}),
    "yarn-untruncated": (128, {"rope_theta": 10000.0, "rope_parameters": {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096,
        "beta_fast": 16, "truncate": False, "mscale": 1.0, "mscale_all_dim": 0.5}}),
}


def rope_config(head_dim: int, extra: dict) -> dict:
    return {**(QWEN if extra.get("model_type") == "qwen2" else TINY), **extra,
            "hidden_size": 4 * head_dim}


def transformers_rope(d: dict, positions: int):
    """(inv_freq, cos half-rows, sin half-rows) of transformers' own rotary embedding."""
    torch = needs_torch()
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(AutoConfig.for_model(**d))  # pyright: ignore[reportArgumentType]
    cos, sin = rotary(torch.zeros(1), torch.arange(positions)[None])
    half = cos.shape[-1] // 2
    return rotary.inv_freq.numpy(), cos[0, :, :half].numpy(), sin[0, :, :half].numpy()


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_tables_are_transformers_to_the_ulp(name):
    """At positions 0..8191: the inverse frequencies bit for bit, and every cos and sin
    within 1 ulp of transformers' (2 with yarn's attention factor, which multiplies
    values rounded once already, each side's own rounding)."""
    d = rope_config(*ROPES[name])
    config = LMConfig.from_dict(d)
    inv, cos, sin = transformers_rope(d, 8192)
    assert np.array_equal(rope_inv_freq(config), inv)
    ours = rope_tables(config, 8192)
    bound = 1 if config.rope.attention_factor == 1.0 else 2
    assert ours[0].dtype == np.float32 and ours[0].shape == (8192, config.head_dim // 2)
    assert ulps(ours[0], cos) <= bound and ulps(ours[1], sin) <= bound
    assert config.rope.rope_type in SUPPORTED_ROPE


@pytest.mark.parametrize("theta, head_dim", [(1e6, 128), (150000.0, 64), (75000.0, 256)])
def test_rope_where_the_power_differs_from_torchs(theta, head_dim):
    """Where torch's float32 pow is not correctly rounded (these pairs), inv_freq is
    within 2 ulps of torch's, a table is off by position * that ulp; with torch's own
    inv_freq (a model's rotary buffer) the tables are within 1 ulp again."""
    d = rope_config(head_dim, {"rope_theta": theta})
    config = LMConfig.from_dict(d)
    inv, cos, sin = transformers_rope(d, 8192)
    ours = rope_inv_freq(config)
    assert not np.array_equal(ours, inv) and ulps(ours, inv) <= 2  # pow's ulp, then 1 / it
    off = np.abs(ours.astype(np.float64) - inv).max() * 8192
    assert np.abs(rope_tables(config, 8192)[0] - cos).max() <= off + 2 ** -24
    given = rope_tables(config, 8192, inv_freq=inv)
    assert ulps(given[0], cos) <= 1 and ulps(given[1], sin) <= 1


def test_rope_tables_refuse_bad_arguments():
    config = LMConfig.from_dict(TINY)
    for positions in (0, 2**24 + 1, 3.0, True):
        with pytest.raises(ModelError, match="positions must be an int from 1 to 16777216"):
            rope_tables(config, positions)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ModelError, match=r"inv_freq must be 8 finite floats \(head_dim / 2\), "
                                         r"got float32 \(7,\)"):
        rope_tables(config, 4, inv_freq=np.ones(7, np.float32))


# ---------------------------------------------------------------- what a device holds

def test_memory_check_splits_a_weight_over_a_binding_into_row_chunks():
    """Qwen2.5-0.5B's embedding in f16 (272 MB) at WebGPU's default limits: three
    chunks of rows, none over a binding; everything else bound whole."""
    qwen = LMConfig.from_dict({"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
                               "intermediate_size": 4864, "num_hidden_layers": 24,
                               "num_attention_heads": 14, "num_key_value_heads": 2,
                               "tie_word_embeddings": True})
    plan = memory_check(qwen, WEBGPU_DEFAULTS, np.float16)
    embedding = plan["model.embed_tokens.weight"]
    assert embedding == WeightSplit((151936, 896), 272269312, 3, 134217728 // 1792)
    assert embedding.rows_per_chunk * 1792 <= 134217728 < (embedding.rows_per_chunk + 1) * 1792
    assert all(s.chunks == 1 for n, s in plan.items() if n != "model.embed_tokens.weight")
    assert plan["rope.cos"] == WeightSplit((32768, 32), 32768 * 32 * 4, 1, 32768)
    assert memory_check(qwen, WEBGPU_DEFAULTS)["model.embed_tokens.weight"].chunks == 5


def test_memory_check_refuses_sizes_no_device_holds_before_anything_is_allocated():
    huge = LMConfig.from_dict({**TINY, "hidden_size": 10**9, "num_attention_heads": 4})
    with pytest.raises(ModelError, match=r"model.embed_tokens.weight \[128, 1000000000\] "
                                         r"float32 is 512000000000 bytes: it is bound in chunks "
                                         r"of whole rows, each a buffer and a binding of at most "
                                         r"134217728 bytes \(max-buffer-size = 268435456, "
                                         r"max-storage-buffer-binding-size = 134217728\), and "
                                         r"one row is 4000000000 bytes"):
        memory_check(huge, WEBGPU_DEFAULTS)
    from shaderdsl.interp import Device  # a device's limits, given as the device

    tiny = memory_check(LMConfig.from_dict(TINY), Device(), np.float16)
    assert tiny["lm_head.weight"] == WeightSplit((128, 64), 128 * 64 * 2, 1, 128)
    for bad, match in (({"max-buffer-size": 4}, "must be a device or its limits"),
                       (None, "must be a device or its limits")):
        with pytest.raises(ModelError, match=match):
            memory_check(LMConfig.from_dict(TINY), bad)
    with pytest.raises(ModelError, match="dtype must be float32 or float16"):
        memory_check(LMConfig.from_dict(TINY), WEBGPU_DEFAULTS, np.float64)


# ---------------------------------------------------------------- a folder, no torch

@pytest.mark.parametrize("stored", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("shards", [0, 3])
def test_a_folder_reads_as_written(tmp_path, stored, shards):
    """Every tensor, in the model's order, its values as stored (BF16 widened exactly),
    as float32 or float16; sharded with an index or not."""
    tensors = random_weights(QWEN)
    folder = write_folder(tmp_path / "m", QWEN, tensors, stored, shards)
    for dtype in (np.float32, np.float16):
        weights = load_weights(folder, dtype)
        assert isinstance(weights, LMWeights) and not weights.tied
        assert list(weights) == list(weight_shapes(weights.config)) == list(tensors)
        assert weights.config == LMConfig.from_dict(QWEN) == read_config(folder)
        for name, values in tensors.items():
            kept = values.astype(np.float16) if stored == "F16" else values
            got = weights[name]
            assert got.dtype == dtype and np.array_equal(got, kept.astype(dtype)), name


def test_tied_heads_are_read_as_transformers_ties_them(tmp_path):
    """No head: the embedding serves. A head equal to the embedding: tied. Another head:
    its own weight, with a warning. A head and no embedding: the head is the embedding."""
    tied = {**TINY, "tie_word_embeddings": True}
    tensors = random_weights(TINY)
    head, embedding = tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]
    without = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    weights = load_weights(write_folder(tmp_path / "a", tied, without))
    assert weights.tied and "lm_head.weight" not in weights and len(weights) == len(without)
    (tmp_path / "a" / "model.safetensors").unlink()  # `in` asks no file, a read does
    assert "model.norm.weight" in weights and "lm_head.weight" not in weights
    with pytest.raises(FileNotFoundError):
        weights["model.norm.weight"]
    same = load_weights(write_folder(tmp_path / "b", tied, {**tensors,
                                                            "lm_head.weight": embedding}))
    assert same.tied and "lm_head.weight" not in same
    with pytest.warns(UserWarning, match="hold different values; as transformers does, they "
                                         "are not tied"):
        other = load_weights(write_folder(tmp_path / "c", tied, tensors))
    assert not other.tied and np.array_equal(other["lm_head.weight"], head)
    only = {k: v for k, v in tensors.items() if k != "model.embed_tokens.weight"}
    swapped = load_weights(write_folder(tmp_path / "d", tied, only, shards=2))
    assert swapped.tied and np.array_equal(swapped["model.embed_tokens.weight"], head)
    assert list(swapped) == list(weights)


def test_a_folder_reads_with_no_torch(tmp_path):
    folder = write_folder(tmp_path / "m", QWEN, random_weights(QWEN), "BF16", shards=2)
    probe = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
             "from lora.models.weights import load_weights\n"
             f"w = load_weights({str(folder)!r}, 'float16')\n"
             "print(len(w), w['model.norm.weight'].dtype, 'torch' in sys.modules and "
             "sys.modules['torch'] is not None)")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["27", "float16", "False"]


def test_old_rotary_buffers_in_a_file_are_left_out(tmp_path):
    tensors = {**random_weights(TINY), "model.layers.0.self_attn.rotary_emb.inv_freq":
               np.ones(8, np.float32)}
    assert list(load_weights(write_folder(tmp_path / "m", TINY, tensors))) == \
        list(weight_shapes(LMConfig.from_dict(TINY)))


def test_a_hugging_face_cache_snapshot_is_followed_into_its_blobs(tmp_path):
    """A cache snapshot's files are links to ../../blobs: those are followed, a link
    elsewhere out of the folder is not."""
    repo = tmp_path / "models--org--tiny"
    source = write_folder(tmp_path / "src", TINY, random_weights(TINY))
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        blob = repo / "blobs" / f"sha-{name}"
        blob.write_bytes((source / name).read_bytes())
        (snapshot / name).symlink_to(Path("../../blobs") / blob.name)
    assert len(load_weights(snapshot)) == len(weight_shapes(LMConfig.from_dict(TINY)))
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(source / "model.safetensors")
    with pytest.raises(ModelError, match="outside the model folder"):
        load_weights(snapshot)


def _bad_folder(tmp_path: Path, case: str) -> Path:
    """A folder with one thing wrong, by name (what FOLDER_REFUSALS expects of it)."""
    tensors = random_weights(TINY)
    folder = tmp_path / "m"
    if case in ("no config", "config not JSON", "no weights"):
        write_folder(folder, TINY, tensors)
        if case == "no config":
            (folder / "config.json").unlink()
        elif case == "config not JSON":
            (folder / "config.json").write_text("{model_type: llama")
        else:
            (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
        return folder
    if case in ("missing tensor", "unexpected tensor", "wrong shape", "I32", "F64", "NaN"):
        if case == "missing tensor":
            del tensors["model.layers.1.mlp.up_proj.weight"]
        elif case == "unexpected tensor":
            tensors["model.layers.2.mlp.up_proj.weight"] = np.zeros((96, 64), np.float32)
        elif case == "wrong shape":
            tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((64, 64), np.float32)
        elif case == "NaN":
            tensors["model.norm.weight"][3] = np.nan
        else:
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(TINY))
            dtype = "I32" if case == "I32" else "F64"
            entries = [(k, "F32", list(v.shape), v.tobytes()) for k, v in tensors.items()]
            name, _, shape, raw = entries[1]
            entries[1] = (name, dtype, shape, raw + (raw if dtype == "F64" else b""))
            (folder / "model.safetensors").write_bytes(raw_safetensors(entries))
            return folder
        return write_folder(folder, TINY, tensors)
    return _bad_shards(folder, case, tensors)


def _bad_shards(folder: Path, case: str, tensors: dict) -> Path:
    write_folder(folder, TINY, tensors, shards=2)
    index = json.loads((folder / INDEX_NAME).read_text())
    weight_map = index["weight_map"]
    first = "model-00001-of-00002.safetensors"
    if case in ("../ shard", "absolute shard", "linked shard"):
        outside = folder.parent / "outside.safetensors"
        os.replace(folder / first, outside)
        name = {"../ shard": "../outside.safetensors", "absolute shard": str(outside),
                "linked shard": first}[case]
        if case == "linked shard":
            (folder / first).symlink_to(outside)
        weight_map.update({k: name for k, v in weight_map.items() if v == first})
    elif case == "missing shard":
        (folder / first).unlink()
    elif case == "listed twice":
        norm = {"model.norm.weight": tensors["model.norm.weight"]}
        write_file(folder / "extra.safetensors", norm)
        weight_map["model.norm.weight"] = "extra.safetensors"
    elif case == "listed in the wrong shard":
        weight_map["model.norm.weight"] = first if weight_map["model.norm.weight"] != first \
            else "model-00002-of-00002.safetensors"
    elif case == "duplicate index key":
        text = json.dumps(index).replace('"weight_map": {', '"weight_map": {"model.norm.weight": '
                                         f'"{first}", ')
        (folder / INDEX_NAME).write_text(text)
        return folder
    elif case == "index not an object":
        index = ["model.safetensors"]
    (folder / INDEX_NAME).write_text(json.dumps(index))
    return folder


FOLDER_REFUSALS = {
    "no config": "m/config.json: missing; a model folder holds config.json beside its weights",
    "config not JSON": "m/config.json: not valid JSON (Expecting property name enclosed in "
                       "double quotes",
    "no weights": "m: no model.safetensors or model.safetensors.index.json: a folder without "
                  "weights lora reads (safetensors); it holds ['pytorch_model.bin']",
    "missing tensor": "m/model.safetensors: model.layers.1.mlp.up_proj.weight [96, 64] is "
                      "missing (the config m/config.json implies it: LlamaForCausalLM)",
    "unexpected tensor": "m/model.safetensors: holds model.layers.2.mlp.up_proj.weight, which "
                         "LlamaForCausalLM of this config does not have (num_hidden_layers 2",
    "wrong shape": "m/model.safetensors: model.layers.0.self_attn.k_proj.weight has shape "
                   "[64, 64]; the config m/config.json implies [32, 64] (vocab_size 128, "
                   "hidden_size 64, intermediate_size 96, 4 heads and 2 kv heads of head_dim 16)",
    "I32": "m/model.safetensors: model.layers.0.self_attn.q_proj.weight is stored as I32; lora "
           "reads F32, F16, BF16",
    "F64": "model.layers.0.self_attn.q_proj.weight is stored as F64; lora reads F32, F16, BF16",
    "NaN": "m/model.safetensors: model.norm.weight: 1 of 64 values are NaN or infinite",
    "../ shard": "m/model.safetensors.index.json: '../outside.safetensors' is not a file name "
                 "inside the model folder (absolute paths and '..' are refused)",
    "absolute shard": "is not a file name inside the model folder (absolute paths and '..' "
                      "are refused)",
    "linked shard": "/model-00001-of-00002.safetensors links to ",
    "missing shard": "m/model.safetensors.index.json: the shard model-00001-of-00002."
                     "safetensors is missing",
    "listed twice": "model.norm.weight is also in ",
    "listed in the wrong shard": "holds model.norm.weight, but ",
    "duplicate index key": "m/model.safetensors.index.json: 'model.norm.weight' is named twice",
    "index not an object": "m/model.safetensors.index.json: expected an object with a "
                           "non-empty weight_map {tensor: shard file}",
}


@pytest.mark.parametrize("case", list(FOLDER_REFUSALS))
def test_bad_folders_are_refused_naming_the_file_and_tensor(tmp_path, monkeypatch, case):
    _bad_folder(tmp_path, case)
    monkeypatch.chdir(tmp_path)  # the messages name paths as given: relative to here
    with pytest.raises(ModelError) as info:
        weights = load_weights("m")
        for name in weights:
            weights[name]  # NaN is found when a tensor is read
    assert FOLDER_REFUSALS[case] in str(info.value), str(info.value)
    assert case == "NaN" or "weights" not in locals()  # refused before any tensor is read


def test_values_beyond_float16_are_refused_when_read_as_float16(tmp_path):
    tensors = random_weights(TINY)
    tensors["model.norm.weight"][5] = 1e6
    weights = load_weights(write_folder(tmp_path / "m", TINY, tensors), np.float16)
    assert weights["lm_head.weight"].dtype == np.float16
    with pytest.raises(ModelError, match=r"model.norm.weight holds 1000000.0, which does not "
                                         r"fit float16 \(largest finite 65504.0\); 1 of 64"):
        weights["model.norm.weight"]
    with pytest.raises(ModelError, match="dtype must be float32 or float16"):
        load_weights(tmp_path / "m", "bfloat16")
    with pytest.raises(ModelError, match="no such model folder"):
        load_weights(tmp_path / "nothing")
    with pytest.raises(ModelError, match="a file, not model folder"):
        load_weights(tmp_path / "m" / "config.json")


# ---------------------------------------------------------------- transformers and peft

def tiny_model(d: dict, seed: int = 0, dtype=None):
    """A transformers causal LM of config ``d``, random weights (seeded)."""
    torch = needs_torch()
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**d))
    return model.to(dtype) if dtype is not None else model


def state_values(model) -> dict[str, np.ndarray]:
    """The model's state_dict as float32 numpy (bfloat16 widened exactly)."""
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch, tied, dtype, shard", [
    ("llama", False, "float32", None), ("qwen2", True, "float32", "40KB"),
    ("llama", True, "bfloat16", "40KB"), ("qwen2", False, "float16", None)])
def test_save_pretrained_folders_read_as_the_model_holds_them(tmp_path, arch, tied, dtype, shard):
    torch = needs_torch()
    d = {**(QWEN if arch == "qwen2" else TINY), "tie_word_embeddings": tied}
    model = tiny_model(d, dtype=getattr(torch, dtype))
    model.save_pretrained(tmp_path / "m", **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "m" / INDEX_NAME).is_file() == bool(shard)
    weights = load_weights(tmp_path / "m")
    state = state_values(model)
    assert weights.tied == tied and weights.config == LMConfig.from_transformers(model.config)
    assert weights.config.dtype == dtype
    assert set(weights) | ({"lm_head.weight"} if tied else set()) == set(state)
    for name in weights:
        assert np.array_equal(weights[name], state[name]), name
    from_memory = weights_from_transformers(model, np.float32)
    assert list(from_memory) == list(weights) and from_memory.tied == tied
    for name in weights:
        assert np.array_equal(from_memory[name], state[name]), name


def test_weights_from_transformers_refuses_what_is_not_a_causal_lm():
    model = tiny_model(TINY)
    with pytest.raises(ModelError, match="expected LlamaForCausalLM .the causal LM with its "
                                         "head. for model_type 'llama', got LlamaModel"):
        weights_from_transformers(model.model)
    with pytest.raises(ModelError, match="got dict"):
        weights_from_transformers({"model.norm.weight": 1})
    with pytest.raises(ModelError, match="LMConfig.from_transformers: expected a transformers "
                                         "config .model.config., got LlamaForCausalLM"):
        LMConfig.from_transformers(model)
    assert weights_from_transformers(model.half(), "float16")["lm_head.weight"].dtype == np.float16


TARGETS = [["q_proj", "v_proj"], "all-linear", "ALL-LINEAR", r".*\.(q|k)_proj",
           ["self_attn.o_proj", "down_proj"], ["lm_head", "gate_proj"], None,
           r"model\.layers\.1\.mlp\.\w+_proj", ("up_proj",), {"model.layers.0.self_attn.v_proj"}]


@pytest.mark.parametrize("targets", TARGETS, ids=str)
def test_resolve_targets_picks_what_peft_wraps(targets):
    """On a tiny LlamaForCausalLM, the modules peft's get_peft_model wraps are exactly
    resolve_targets' (over lm_modules of its config, or over its Linear names alone)."""
    import peft

    model = tiny_model(TINY)
    config = LMConfig.from_transformers(model.config)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=targets))
    theirs = [n for n, m in wrapped.get_base_model().named_modules() if hasattr(m, "lora_A")]
    assert resolve_targets(targets, lm_modules(config)) == theirs
    if targets is None or not isinstance(targets, str) or "all" in targets.lower():
        assert resolve_targets(targets, list(linear_modules(config))) == theirs


TARGET_REFUSALS = [
    (["q_prj"], "target_modules ['q_prj'] matches no module of the model; its Linear layers: "
                "['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj', "
                "'lm_head'], or 'all-linear'"),
    ("q_proj", "target_modules 'q_proj' (a regex, matched against whole names) matches no "
               "module"),
    (["mlp"], "target_modules ['mlp'] picks model.layers.0.mlp, a LlamaMLP; lora puts adapters "
              "on Linear layers"),
    (r"model\.layers\.1\.mlp\..*", "picks model.layers.1.mlp.act_fn, a SiLUActivation; "),
    (["embed_tokens", "q_proj"], "picks model.embed_tokens, an Embedding (peft would put LoRA on "
                                 "the embedding)"),
    ("(q", "resolve_targets: target_modules '(q' is not a valid regex"),
    ([""], "target_modules must be a list of module names, a regex string or 'all-linear', "
           "got ['']"),
    (5, "got 5"),
]


@pytest.mark.parametrize("targets, message", TARGET_REFUSALS, ids=[str(t) for t, _ in
                                                                    TARGET_REFUSALS])
def test_targets_matching_nothing_or_no_linear_are_refused(targets, message):
    with pytest.raises(ModelError, match=re.escape(message)):
        resolve_targets(targets, lm_modules(LMConfig.from_dict(TINY)))


def peft_model(d: dict, **lora):
    """A peft model of a tiny causal LM, its lora_B random (peft starts it at 0)."""
    torch = needs_torch()
    import peft

    model = peft.get_peft_model(tiny_model(d), peft.LoraConfig(**{"r": 4, "lora_alpha": 8,
                                                                  **lora}))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def test_peft_adapter_and_base_weights_of_a_peft_model():
    model = peft_model(QWEN, target_modules="all-linear", rank_pattern={"down_proj": 2},
                       alpha_pattern={r"model\.layers\.1\.self_attn\.q_proj": 3.0},
                       use_rslora=True, lora_dropout=0.1)
    adapter = peft_adapter(model)
    assert (adapter.name, adapter.r, adapter.lora_alpha, adapter.use_rslora,
            adapter.lora_dropout) == ("default", 4, 8.0, True, 0.1)
    assert adapter.rank_pattern == {"down_proj": 2}  # all-linear, as peft expanded it:
    assert adapter.target_modules == sorted(getattr(model.peft_config["default"],
                                                    "target_modules"))
    base = model.get_base_model()
    for name, layer in adapter.layers.items():
        module: Any = base.get_submodule(name)   # a peft LoraLayer: its lora_A, lora_B, scaling
        assert np.array_equal(layer.a, module.lora_A["default"].weight.detach().numpy())
        assert np.array_equal(layer.b, module.lora_B["default"].weight.detach().numpy())
        assert math.isclose(layer.scale, module.scaling["default"], rel_tol=1e-12)
    assert adapter.layers["model.layers.0.mlp.down_proj"].rank == 2
    assert adapter.layers["model.layers.1.self_attn.q_proj"].alpha == 3.0
    weights = weights_from_transformers(model)
    plain = tiny_model(QWEN)  # the same seed: the base before get_peft_model
    assert list(weights) == list(weight_shapes(weights.config))
    for name, values in state_values(plain).items():
        assert np.array_equal(weights[name], values), name


PEFT_REFUSALS = [
    ({"bias": "lora_only"}, "bias='lora_only' trains the base model's biases"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head'] trains whole copies"),
    ({"use_dora": True}, "use_dora=True: lora runs plain LoRA adapters"),
    ({"lora_bias": True}, "lora_bias=True: lora runs plain LoRA adapters"),
    ({"target_modules": ["embed_tokens", "q_proj"]}, "model.embed_tokens is an Embedding with "
                                                     "LoRA"),
]


@pytest.mark.parametrize("lora, message", PEFT_REFUSALS, ids=[str(k) for k, _ in PEFT_REFUSALS])
@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")
def test_peft_models_lora_does_not_run_are_refused_by_name(lora, message):
    model = peft_model(TINY, **{"target_modules": ["q_proj"], **lora})
    with pytest.raises(ModelError, match=re.escape(message)):
        peft_adapter(model)
        weights_from_transformers(model)


def test_a_merged_or_mixed_peft_model_is_refused():
    import peft

    model = peft_model(TINY, target_modules=["q_proj"])
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["v_proj"]))
    getattr(model.base_model, "set_adapter")(["default", "second"])
    with pytest.raises(ModelError, match=r"the peft model has 2 active adapters \['default', "
                                         r"'second'\]; set_adapter\(name\)"):
        peft_adapter(model)
    model.set_adapter("default")
    assert list(peft_adapter(model).layers) == ["model.layers.0.self_attn.q_proj",
                                                "model.layers.1.self_attn.q_proj"]
    model.merge_adapter()
    for read in (peft_adapter, weights_from_transformers):
        with pytest.raises(ModelError, match="merge"):
            read(model)
    with pytest.raises(ModelError, match="peft_adapter: expected a peft model"):
        peft_adapter(tiny_model(TINY))


# ---------------------------------------------------------------- a causal LM's adapter files

def logits(model, ids) -> np.ndarray:
    torch = needs_torch()
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits.numpy()


@pytest.mark.parametrize("d, targets", [(TINY, ["q_proj", "v_proj"]),
                                        ({**QWEN, "tie_word_embeddings": True}, "all-linear")])
def test_a_causal_lms_adapter_round_trips_through_peft(tmp_path, d, targets):
    """peft's save loads here with peft's names, A, B and scales; ours, written from those
    layers with task_type CAUSAL_LM, loads in PeftModel.from_pretrained to the logits of
    the peft model it came from."""
    import peft

    model = peft_model(d, target_modules=targets, rank_pattern={"v_proj": 2}, use_rslora=True)
    model.eval()
    model.save_pretrained(tmp_path / "peft")
    taken = peft_adapter(model).layers
    read = load_adapter(tmp_path / "peft")
    assert list(read) == sorted(taken) and "model.layers.0.self_attn.q_proj" in read
    for name, layer in taken.items():
        assert np.array_equal(read[name].a, layer.a) and np.array_equal(read[name].b, layer.b)
        assert math.isclose(read[name].scale, layer.scale, rel_tol=1e-12), name
    ours = save_adapter(tmp_path / "ours", {n: (x.a, x.b) for n, x in taken.items()},
                        alpha={n: x.alpha for n, x in taken.items()}, use_rslora=True,
                        target_modules=resolve_targets(targets, lm_modules(
                            LMConfig.from_transformers(model.config))),
                        task_type="CAUSAL_LM", base_model_name_or_path=str(tmp_path / "base"))
    written = json.loads((ours / "adapter_config.json").read_text())
    assert (written["task_type"], written["base_model_name_or_path"]) == \
        ("CAUSAL_LM", str(tmp_path / "base"))
    assert written["target_modules"] == sorted(taken)
    loaded = peft.PeftModel.from_pretrained(tiny_model(d), ours)
    loaded.eval()
    assert type(loaded).__name__ == "PeftModelForCausalLM"
    ids = [[3, 17, 99, 5, 64, 2, 127, 0]]
    want = logits(model, ids)
    assert np.abs(logits(loaded, ids) - want).max() <= 1e-6 * np.abs(want).max()
    assert np.abs(logits(tiny_model(d), ids) - want).max() > 1e-3  # the adapter matters


def test_save_adapter_refuses_options_peft_would_read_otherwise(tmp_path):
    layers = {"model.layers.0.self_attn.q_proj": (np.ones((2, 4)), np.zeros((4, 2)))}
    for option, message in (({"use_rslora": "false"}, "use_rslora must be True or False, got "
                                                      "'false'"),
                            ({"task_type": "causal_lm"}, "task_type must be None or one of "
                                                         "peft's"),
                            ({"base_model_name_or_path": 5}, "base_model_name_or_path must be "
                                                             "a str or None, got 5")):
        with pytest.raises(AdapterFileError, match=re.escape(message)):
            save_adapter(tmp_path / "a", layers, alpha=4,
                         **option)  # pyright: ignore[reportArgumentType]
    assert not (tmp_path / "a").exists()
