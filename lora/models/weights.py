"""A causal LM's weights by transformers' names: read from a local Hugging Face folder
with numpy and safetensors alone (no torch), or taken from a transformers or peft model
in memory.

    weights = load_weights("SmolLM2-135M", np.float16)   # checked before anything is read
    weights.config                                      # the folder's LMConfig
    embedding = weights["model.embed_tokens.weight"]    # read now, as float16

A folder is untrusted input. Its config.json is checked value by value (LMConfig); its
weights are model.safetensors, or the shards model.safetensors.index.json names, which
must stay inside the folder (``../``, absolute names and links out are refused; the
links of a Hugging Face cache snapshot into its repository's ``blobs`` are followed).
Every tensor the config implies must be there once, of the shape it implies, stored as
F32, F16 or BF16, and nothing else may be; each problem is a ModelError naming the file
and the tensor, raised before any tensor is read. A tied head (``tie_word_embeddings``)
is the embedding; a file that also holds ``lm_head.weight`` is read as transformers
does: the same values tie, other values make the head a weight of its own (a warning
says so, as transformers' does), and a head without an embedding is the embedding.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
from numpy.typing import DTypeLike
from safetensors import SafetensorError, safe_open

from ..core.checks import host_values
from ..core.tensorfile import narrowed, read_header, read_values
from .adapters import active_config
from .checks import ModelError
from .config import LMConfig, weight_shapes

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
STORED_DTYPES = ("F32", "F16", "BF16")
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"
# Buffers older conversions saved beside the weights; transformers recomputes them.
IGNORED_SUFFIX = ".rotary_emb.inv_freq"


def _load_dtype(dtype) -> np.dtype:
    try:
        out = np.dtype(dtype) if dtype is not None else None
    except TypeError:  # a name numpy does not know: 'bfloat16'
        out = None
    if out not in (np.float32, np.float16):
        raise ModelError(f"dtype must be float32 or float16 (the weights as stored on the "
                         f"GPU), got {dtype!r}")
    return out  # type: ignore[return-value]


def _finite(where, name: str, values: np.ndarray) -> np.ndarray:
    """``values``, or ModelError where any is NaN or infinite (it would poison every
    output it touches), naming where it came from."""
    bad = int(values.size - np.count_nonzero(np.isfinite(values)))
    if bad:
        raise ModelError(f"{where}: {name}: {bad} of {values.size} values are NaN or infinite")
    return values


class LMWeights(Mapping):
    """A causal LM's weights: ``{transformers' name: numpy array}`` in the model's order,
    each of ``dtype`` (float32 or float16) and read when asked for (from the file, or
    from the model's tensor): reading a name twice reads it twice, and nothing is held
    here, so a caller that uploads each weight and drops it holds one at a time. A value
    that is NaN or infinite, or beyond float16 read as float16, is refused when read.
    ``lm_head.weight`` is absent where the head is the embedding (``tied``).
    ``inv_freq``: the model's own rotary ``inv_freq`` where the weights came from a
    model in memory (rope_tables takes it), else None."""

    def __init__(self, config: LMConfig, readers: dict[str, Callable[[], np.ndarray]],
                 dtype, source: str, inv_freq: np.ndarray | None = None):
        self.config, self.dtype, self.source = config, _load_dtype(dtype), source
        self.inv_freq = inv_freq
        self._readers = readers

    def __getitem__(self, name: str) -> np.ndarray:
        return self._readers[name]()

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor
        return name in self._readers

    def __iter__(self) -> Iterator[str]:
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)

    @property
    def tied(self) -> bool:
        """Whether the LM head is the embedding (no ``lm_head.weight`` of its own)."""
        return HEAD not in self._readers

    def __repr__(self) -> str:
        return (f"<LMWeights {self.config.architecture} {len(self)} tensors {self.dtype.name}"
                f"{' tied' if self.tied else ''} from {self.source}>")


# ---------------------------------------------------------------- the folder's files

def _folder(folder) -> Path:
    path = Path(folder)
    if not path.is_dir():
        raise ModelError(f"{path}: {'a file, not' if path.exists() else 'no such'} model "
                         f"folder (a folder holding {CONFIG_NAME} and {WEIGHTS_NAME} or "
                         f"{INDEX_NAME} with its shards)")
    return path


def _hub_blob(root: Path, real: Path) -> bool:
    """Whether ``real`` is a blob of the Hugging Face cache repository whose snapshot
    ``root`` is (``<repo>/snapshots/<revision>``, its files links to ``<repo>/blobs``)."""
    return root.parent.name == "snapshots" and real.parent == root.parent.parent / "blobs"


def inside(folder: Path, name, named_by: str) -> Path:
    """``folder / name`` where ``name`` is a relative path that stays inside ``folder``
    (links resolved); ModelError naming ``named_by`` (the file that names it)."""
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if not name or not isinstance(name, str) or PurePosixPath(name).is_absolute() or \
            Path(name).is_absolute() or ".." in parts or "\\" in name or "\0" in name:
        raise ModelError(f"{named_by}: {name!r} is not a file name inside the model folder "
                         f"(absolute paths and '..' are refused)")
    path, root = folder / name, folder.resolve()
    real = path.resolve()
    if not (real.is_relative_to(root) or _hub_blob(root, real)):
        raise ModelError(f"{named_by}: {path} links to {real}, outside the model folder "
                         f"{root}; links out of the folder are refused")
    return path


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_no_twice(path))
    except (ValueError, UnicodeDecodeError) as e:
        if isinstance(e, ModelError):
            raise
        raise ModelError(f"{path}: not valid JSON ({e})") from e
    except RecursionError as e:
        raise ModelError(f"{path}: not valid JSON (nested too deeply to read)") from e


def _no_twice(path: Path):
    """A JSON object hook refusing a key named twice (json keeps the last silently)."""
    def pairs_to_dict(pairs: list) -> dict:
        twice = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        if twice:
            raise ModelError(f"{path}: {twice[0]!r} is named twice")
        return dict(pairs)
    return pairs_to_dict


def read_config(folder) -> LMConfig:
    """The LMConfig of a model folder's config.json, checked."""
    folder = _folder(folder)
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise ModelError(f"{path}: missing; a model folder holds {CONFIG_NAME} beside its "
                         f"weights")
    return LMConfig.from_dict(_json(inside(folder, CONFIG_NAME, str(folder))), source=str(path))


def _weight_files(folder: Path) -> tuple[list[Path], dict[str, Path] | None, str]:
    """(the safetensors files, {tensor: its file} from the index or None, what names
    them): model.safetensors where it is (transformers reads it first), else the index."""
    if (folder / WEIGHTS_NAME).is_file():
        return [inside(folder, WEIGHTS_NAME, str(folder))], None, str(folder / WEIGHTS_NAME)
    index = folder / INDEX_NAME
    if not index.is_file():
        held = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth",
                                                                       ".safetensors", ".gguf"))
        holds = f"; it holds {held}" if held else ""
        raise ModelError(f"{folder}: no {WEIGHTS_NAME} or {INDEX_NAME}: a folder without "
                         f"weights lora reads (safetensors){holds}")
    text = _json(inside(folder, INDEX_NAME, str(folder)))
    weight_map = text.get("weight_map") if isinstance(text, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelError(f"{index}: expected an object with a non-empty weight_map "
                         f"{{tensor: shard file}}")
    where = {name: inside(folder, shard, str(index)) for name, shard in weight_map.items()}
    return sorted(set(where.values())), where, str(index)


# ---------------------------------------------------------------- the tensors

class _Stored:
    """Where a tensor is: its file, the key it has there, the file's header."""

    def __init__(self, file: Path, key: str, length: int, header: dict):
        self.file, self.key, self.length, self.header = file, key, length, header
        self.dtype, self.shape = header[key]["dtype"], tuple(header[key]["shape"])

    def read(self, dtype) -> np.ndarray:
        with safe_open(str(self.file), framework="np") as f:
            return _finite(self.file, self.key, read_values(
                self.file, f, self.key, self.length, self.header, dtype, ModelError))


def _tensors_of(file: Path, named_by: str) -> dict[str, _Stored]:
    """Every tensor of one safetensors file, its header checked (by safetensors, and here
    for a key named twice) and each dtype one lora reads."""
    if not file.is_file():
        raise ModelError(f"{named_by}: the shard {file.name} is missing ({file})")
    length, header = read_header(file, ModelError)
    try:
        with safe_open(str(file), framework="np") as f:
            keys = list(f.keys())
    except (SafetensorError, OSError) as e:
        raise ModelError(f"{file}: not a readable safetensors file ({e})") from e
    for key in keys:
        if header[key]["dtype"] not in STORED_DTYPES:
            raise ModelError(f"{file}: {key} is stored as {header[key]['dtype']}; lora reads "
                             f"{', '.join(STORED_DTYPES)}")
    return {key: _Stored(file, key, length, header) for key in keys}


def _stored_tensors(files: list[Path], index: dict[str, Path] | None,
                    named_by: str) -> dict[str, _Stored]:
    """Every tensor of the files, each in exactly one, and where the index names it."""
    found: dict[str, _Stored] = {}
    for file in files:
        for key, stored in _tensors_of(file, named_by).items():
            if key in found:
                raise ModelError(f"{file}: {key} is also in {found[key].file.name}: a tensor "
                                 f"listed twice")
            if index is not None and index.get(key) != file:
                said = f"places it in {index[key].name}" if key in index else "does not list it"
                raise ModelError(f"{file}: holds {key}, but {named_by} {said}")
            found[key] = stored
    for key, file in (index or {}).items():
        if key not in found:
            raise ModelError(f"{named_by}: {key} is listed in {file.name}, which does not "
                             f"hold it")
    return found


def _sizes_said(config: LMConfig) -> str:
    c = config
    return (f"vocab_size {c.vocab_size}, hidden_size {c.hidden_size}, intermediate_size "
            f"{c.intermediate_size}, {c.num_attention_heads} heads and {c.num_key_value_heads} "
            f"kv heads of head_dim {c.head_dim}")


def _check_names(config: LMConfig, shapes: dict[str, tuple], expected: dict[str, tuple],
                 where: Callable[[str], str]) -> None:
    """``shapes`` (what is there) holds every tensor of ``expected`` with its shape and
    nothing else; ModelError naming the tensor and ``where(name)`` (its file)."""
    for name, want in expected.items():
        if name not in shapes:
            raise ModelError(f"{where(name)}: {name} {list(want)} is missing (the config "
                             f"{config.source} implies it: {config.architecture})")
        if name in shapes and tuple(shapes[name]) != want:
            raise ModelError(f"{where(name)}: {name} has shape {list(shapes[name])}; the config "
                             f"{config.source} implies {list(want)} ({_sizes_said(config)})")
    for name in shapes:
        if name not in expected:
            raise ModelError(f"{where(name)}: holds {name}, which {config.architecture} of "
                             f"this config does not have (num_hidden_layers "
                             f"{config.num_hidden_layers}, biases: q/k/v {config.qkv_bias}, o "
                             f"{config.o_bias}, mlp {config.mlp_bias})")


def _expected(config: LMConfig, names) -> dict[str, tuple]:
    """weight_shapes, with a tied config's lm_head.weight allowed where it is there."""
    expected = weight_shapes(config)
    if config.tie_word_embeddings and HEAD in names:
        expected[HEAD] = (config.vocab_size, config.hidden_size)
    return expected


def _digest(values: np.ndarray) -> bytes:
    """The values' identity as torch.equal sees it (-0.0 equals 0.0)."""
    return hashlib.sha256((values.astype(np.float32) + np.float32(0)).tobytes()).digest()


def _tie(config: LMConfig, named: dict[str, _Stored], named_by: str) -> dict[str, _Stored]:
    """A tied config's head, as transformers ties it: a head without an embedding is
    the embedding; a head equal to the embedding goes; another head stays, untied."""
    if not config.tie_word_embeddings or HEAD not in named:
        return named
    if EMBEDDING not in named:
        return {EMBEDDING: named[HEAD], **{k: v for k, v in named.items() if k != HEAD}}
    if _digest(named[HEAD].read(np.float32)) == _digest(named[EMBEDDING].read(np.float32)):
        return {k: v for k, v in named.items() if k != HEAD}
    warnings.warn(f"{named_by}: tie_word_embeddings is true, but {HEAD} and {EMBEDDING} hold "
                  f"different values; as transformers does, they are not tied (the head is "
                  f"its own weight)", stacklevel=3)
    return named


def load_weights(folder, dtype: DTypeLike = np.float32) -> LMWeights:
    """The weights of a local Hugging Face model folder (config.json and safetensors,
    sharded or not; F32, F16 or BF16), as ``dtype`` (float32 or float16), every file,
    name and shape checked before any tensor is read. No torch."""
    dtype = _load_dtype(dtype)
    folder = _folder(folder)
    config = read_config(folder)
    files, index, named_by = _weight_files(folder)
    found = _stored_tensors(files, index, named_by)
    named = {k: v for k, v in found.items() if not k.endswith(IGNORED_SUFFIX)}
    if config.tie_word_embeddings and HEAD in named and EMBEDDING not in named:
        named = _tie(config, named, named_by)
    expected = _expected(config, named)
    _check_names(config, {k: v.shape for k, v in named.items()}, expected,
                 lambda name: str(named[name].file) if name in named else named_by)
    named = _tie(config, named, named_by)
    readers = {name: (lambda s=named[name]: s.read(dtype)) for name in expected if name in named}
    return LMWeights(config, readers, dtype, str(folder))


# ---------------------------------------------------------------- a model in memory

def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _from_tensor(source: str, name: str, tensor, dtype: np.dtype) -> np.ndarray:
    """A torch tensor's values as a numpy copy of ``dtype`` (bfloat16 widened exactly)."""
    values = host_values(tensor)
    return _finite(source, name, values.copy() if values.dtype == dtype else
                   narrowed(Path(source), name, values, dtype, ModelError))


def _model_config(base) -> LMConfig:
    """The LMConfig of a transformers model, which must be the causal LM with its head."""
    if not hasattr(base, "state_dict") or not hasattr(base, "config"):
        raise ModelError(f"expected a transformers LlamaForCausalLM or Qwen2ForCausalLM (or a "
                         f"peft model of one), got {type(base).__name__}")
    config = LMConfig.from_transformers(base.config)
    if type(base).__name__ != config.architecture:
        raise ModelError(f"expected {config.architecture} (the causal LM with its head) for "
                         f"model_type {config.model_type!r}, got {type(base).__name__}")
    return config


def _base_tensors(base, config: LMConfig) -> dict:
    """The base model's tensors by transformers' names: peft's ``base_layer`` unwrapped,
    its LoRA tensors left out, a head that is the embedding's tensor once."""
    tensors = {key.replace(".base_layer.", "."): t for key, t in base.state_dict().items()
               if ".lora_" not in key and not key.endswith(IGNORED_SUFFIX)}
    head, embedding = tensors.get(HEAD), tensors.get(EMBEDDING)
    if head is not None and embedding is not None and config.tie_word_embeddings and \
            head.data_ptr() == embedding.data_ptr() and head.shape == embedding.shape:
        del tensors[HEAD]
    return tensors


def _inv_freq(base) -> np.ndarray | None:
    rotary = getattr(getattr(base, "model", None), "rotary_emb", None)
    inv = getattr(rotary, "inv_freq", None)
    return None if inv is None else host_values(inv.float()).astype(np.float32)


def weights_from_transformers(model, dtype: DTypeLike = np.float32) -> LMWeights:
    """The weights of a transformers LlamaForCausalLM / Qwen2ForCausalLM in memory (its
    state_dict; a tied head once), or the base weights of a peft model of one (the LoRA
    not merged; peft_adapter gives the adapter), as ``dtype``, read when asked for.
    ``inv_freq`` is the model's own rotary buffer."""
    storage = _load_dtype(dtype)
    base = model
    if _is_peft(model):
        active_config(model)
        base = model.get_base_model()
        merged = [name for name, m in base.named_modules() if getattr(m, "merged_adapters", None)]
        if merged:
            raise ModelError(f"the adapter is merged into the base weights ({merged[0]}, ...: "
                             f"merge_adapter); call model.unmerge_adapter() first, so that the "
                             f"base weights are the base's")
    config = _model_config(base)
    source = type(base).__name__
    tensors = _base_tensors(base, config)
    _check_names(config, {k: tuple(t.shape) for k, t in tensors.items()},
                 _expected(config, tensors), lambda name: source)
    readers = {name: (lambda n=name: _from_tensor(source, n, tensors[n], storage))
               for name in _expected(config, tensors)}
    return LMWeights(config, readers, storage, source, _inv_freq(base))
