"""Random-weight Hugging Face model folders written with numpy and safetensors alone
(no torch): what the page's tests load, and the benchmark's SmolLM2-135M-shaped model.

    folder = random_folder(tmp / "tiny", TINY)                  # config.json, model.safetensors
    folder = random_folder(tmp / "smol", SMOLLM2_135M, "bfloat16")
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..models.config import LMConfig, weight_shapes
from ..models.weights import EMBEDDING

# A tiny Llama the tests load in a page: byte ids fit its vocabulary (the demo's text);
# every weight under lora.training.network.TILED_FROM values, so the plain products (a
# software GPU compiles the tiled ones slowly).
TINY = {"model_type": "llama", "hidden_size": 48, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 320, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
# SmolLM2-135M's shape (its config.json's sizes), for the benchmarks.
SMOLLM2_135M = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 0,
                "eos_token_id": 0, "pad_token_id": None}
DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def random_weights(config: LMConfig, seed: int = 0, tied_head: bool = True) -> dict:
    """{name: float32 array} for ``config``: N(0, 0.02) matrices as transformers draws
    them, but the embedding N(0, 0.25) (nearer a trained model's: at 0.02 a tied head's
    logits stay within +-1 and a fine-tune can hardly lower the loss), norm weights
    1 + N(0, 0.2) and biases N(0, 0.1) (not 1 and 0, which would hide a kernel that
    skipped them); an untied head too where ``tied_head`` is False."""
    rng = np.random.default_rng(seed)
    shapes = weight_shapes(config)
    if not tied_head or not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            values = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            values = 0.1 * rng.standard_normal(shape)
        else:
            values = (0.25 if name == EMBEDDING else 0.02) * rng.standard_normal(shape)
        out[name] = values.astype(np.float32)
    return out


def _stored(values: np.ndarray, dtype: str) -> tuple[bytes, str]:
    """The bytes of float32 ``values`` stored as ``dtype`` (bfloat16 rounded to nearest
    even from float32's bits), and safetensors' name of it."""
    if dtype == "bfloat16":
        bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return rounded.astype(np.uint16).tobytes(), "BF16"
    return values.astype(dtype).tobytes(), DTYPES[dtype]


def write_safetensors(path: Path, tensors: dict, dtype: str = "float32") -> None:
    """A safetensors file of ``tensors`` (float32 arrays) stored as ``dtype``, in the
    order given, one tensor at a time (a large model is not held twice)."""
    header, at = {}, 0
    for name, values in tensors.items():
        size = values.size * (4 if dtype == "float32" else 2)
        header[name] = {"dtype": DTYPES[dtype], "shape": list(values.shape),
                        "data_offsets": [at, at + size]}
        at += size
    text = json.dumps({"__metadata__": {"format": "pt"}, **header}).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for values in tensors.values():
            f.write(_stored(values, dtype)[0])


def random_folder(folder, config: dict, dtype: str = "float32", seed: int = 0) -> Path:
    """A model folder (config.json, model.safetensors) of random weights for ``config``
    (a config.json's dict), stored as ``dtype`` (float32, float16 or bfloat16)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    parsed = LMConfig.from_dict(config, source=str(folder / "config.json"))
    write_safetensors(folder / "model.safetensors", random_weights(parsed, seed), dtype)
    return folder
