"""LoRA adapter files: peft's directory and Hesper's binary file, read and written.

peft (the reference implementation most trained adapters come from) saves a
directory holding ``adapter_config.json`` and ``adapter_model.safetensors``;
Hesper (``Hesper/LoRA/IO.lean`` in Verilean/hesper) saves one binary file of
Q and V adapters per transformer layer. Both load into ``{module name:
LoraLayer}``. The module is numpy, safetensors, json and regex only, so adapters can
be inspected and converted on a machine without wgpu.

    from lora.training.adapter_io import load_adapter, save_adapter
    layers = load_adapter("my-adapter")       # {"model.layers.0.self_attn.q_proj": LoraLayer}
    save_adapter("copy", {m: (l.a, l.b) for m, l in layers.items()}, alpha=16)

Every problem with a file, or with arrays given to a saver, raises
:class:`AdapterFileError` naming the file (and the tensor key or module);
loaders build the whole result before returning and savers check everything
before writing, so nothing is ever half-loaded or half-written.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import re
import struct
import uuid
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import regex
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ..core.checks import count, host_values
from ..core.tensorfile import read_header, read_values

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."

HESPER_MAGIC = 0x4C4F5241  # "LORA" as a little-endian u32: bytes 41 52 4F 4C
HESPER_VERSION = 1
HESPER_HEADER = struct.Struct("<IIIfII")  # magic, version, rank, alpha, numLayers, reserved

# Stored dtypes read as they are (F32, F16) and those converted to float32 as they are read:
# BF16 widened exactly (numpy has no bfloat16: its bits are the top half of a float32's),
# F64 narrowed to the nearest float32, refused where a value is beyond float32's range.
_KEPT_DTYPES = {"F32": np.float32, "F16": np.float16}
_CONVERTED_DTYPES = ("BF16", "F64")
_DTYPES_EXPECTED = "F32, F16, BF16 or F64 expected"
_KEY = re.compile(r"(?P<module>.+?)\.lora_(?P<part>[AB])(?:\.(?P<adapter>[^.]+))?\.weight")
_HESPER_PARTS = ("q", "v")
# Names that reach the objects every script shares in JavaScript (Object.prototype,
# Object): refused as a part of any key, so a file is read alike here and in the page.
RESERVED_NAMES = ("__proto__", "constructor", "prototype")
# A name regex of a config runs on short module names; one that takes longer backtracks
# catastrophically (``(a+)+`` doubles its work per letter): refuse it instead of hanging.
REGEX_SECONDS = 0.25
# The config's switches, each read as a JSON boolean.
FLAG_FIELDS = ("use_rslora", "fan_in_fan_out", "use_dora")
# peft's TaskType values: what task_type may say (PeftModel.from_pretrained picks its class by it).
PEFT_TASK_TYPES = ("SEQ_CLS", "SEQ_2_SEQ_LM", "CAUSAL_LM", "TOKEN_CLS", "QUESTION_ANS",
                   "FEATURE_EXTRACTION")


class AdapterFileError(ValueError):
    """A LoRA adapter file (or the arrays to save into one) is not what the
    format says; the message names the file and, where there is one, the key."""


class AdapterExtrasWarning(UserWarning):
    """A peft adapter holds tensors beside its LoRA pairs (``modules_to_save``
    heads, trained biases) that ``load_adapter`` does not apply."""


@dataclass(frozen=True, eq=False)
class LoraLayer:
    """One module's adapter: A ``[rank, in_dim]``, B ``[out_dim, rank]`` as stored
    (float32 or float16), and the alpha that scales ``B @ (A @ x)``.

    ``fan_in_fan_out`` is recorded as the file says, but it never changes the
    shapes here: peft stores lora_A/lora_B as ``[r, in]``/``[out, r]`` either
    way, and only transposes the merged delta for Conv1D-style base weights.
    """

    a: np.ndarray
    b: np.ndarray
    alpha: float
    use_rslora: bool = False
    fan_in_fan_out: bool = False

    def __post_init__(self):
        a, b = host_values(self.a), host_values(self.b)  # torch tensors too
        object.__setattr__(self, "a", a)
        object.__setattr__(self, "b", b)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] < 1 or b.shape[1] != a.shape[0]:
            raise ValueError(f"LoraLayer: A must be [rank, in] and B [out, rank], got A "
                             f"{tuple(a.shape)} and B {tuple(b.shape)}")

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def in_dim(self) -> int:
        return self.a.shape[1]

    @property
    def out_dim(self) -> int:
        return self.b.shape[0]

    @property
    def scale(self) -> float:
        """``alpha / rank``, or ``alpha / sqrt(rank)`` for rank-stabilised LoRA (as peft)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


# ---------------------------------------------------------------- shared checks

def _count_nonfinite(array: np.ndarray) -> int:
    return int(array.size - np.count_nonzero(np.isfinite(array)))


def _check_finite(where: str, array: np.ndarray) -> None:
    """NaN or inf in an adapter poisons every output it touches: refuse, with the count."""
    bad = _count_nonfinite(array)
    if bad:
        raise AdapterFileError(f"{where}: {bad} of {array.size} values are NaN or infinite")


def _positive_int(value, where: str, what: str) -> int:
    """lora's positive-int check (core.checks.count), raising AdapterFileError."""
    return count(value, f"{where}: {what}", error=AdapterFileError)


def _finite_real(value, where: str, what: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value)):
        raise AdapterFileError(f"{where}: {what} must be a finite number, got {value!r}")
    return float(value)


def _storable(value, where: str) -> np.ndarray:
    """``value`` as the array to write: float16 stays float16 (halves the file,
    and the GPU can use it as is), every other real float becomes float32."""
    arr = host_values(value)
    if arr.dtype.kind != "f":
        raise AdapterFileError(f"{where}: dtype {arr.dtype.name} is not a real float; "
                               f"float32 or float16 expected (float64 is cast to float32)")
    if arr.dtype != np.float16:
        with np.errstate(over="ignore"):  # beyond float32: inf, refused below
            arr = arr.astype(np.float32)
    _check_finite(where, arr)
    return np.ascontiguousarray(arr)


def _host_pair(where: str, value) -> tuple[np.ndarray, np.ndarray]:
    """The (A, B) of one module to save, shape-checked: A ``[r, in]``, B ``[out, r]``."""
    if isinstance(value, LoraLayer):
        value = (value.a, value.b)
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise AdapterFileError(f"{where}: expected an (A, B) pair, got {type(value).__name__}")
    a, b = _storable(value[0], f"{where} A"), _storable(value[1], f"{where} B")
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] < 1 or b.shape[1] != a.shape[0]:
        raise AdapterFileError(f"{where}: A must be [r, in] and B [out, r] with the same r, "
                               f"got A {tuple(a.shape)} and B {tuple(b.shape)}")
    return a, b


def _commit(writes: dict) -> None:
    """Write each file under a temporary name beside it, then rename them all into
    place: a failure while writing leaves the old files (or none), never half a file."""
    temps = {}
    try:
        for final, write in writes.items():
            temps[final] = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
            write(temps[final])
    except BaseException:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
        raise
    for final, tmp in temps.items():
        os.replace(tmp, final)


# ---------------------------------------------------------------- peft: config

def _regex_match(file, what: str, pattern: str, module: str, whole: str) -> bool:
    """peft's match of a config regex (``re`` semantics, through the ``regex`` module
    for its time limit): ``whole`` the pattern wrapped as peft wraps it."""
    try:
        return regex.fullmatch(whole, module, timeout=REGEX_SECONDS) is not None
    except TimeoutError as e:
        raise AdapterFileError(f"{file}: {what} {pattern!r} took over {REGEX_SECONDS} s "
                               f"on module {module!r} (catastrophic backtracking: a repeated "
                               f"group whose choices match the same text)") from e


def _pattern_value(pattern: dict, module: str, default, file, name: str):
    """peft's rank_pattern/alpha_pattern lookup: the first key (a regex) that
    matches a dotted suffix of the module name, else the default."""
    for key, value in pattern.items():
        if _regex_match(file, f"{name} key", key, module, rf"(.*\.)?({key})"):
            return value
    return default


def target_matches(target_modules, module: str, file) -> bool:
    """peft's check: a regex string must fullmatch the module name; a list entry
    must be the whole name or a dotted suffix of it (``q_proj``, ``self_attn.q_proj``).
    The one statement of the rule: lora.models.targets reads target_modules with it."""
    if target_modules is None or target_modules == "all-linear":
        return True  # peft expands "all-linear" when it builds the model: no list to check
    if isinstance(target_modules, str):
        return _regex_match(file, "target_modules", target_modules, module, target_modules)
    return module in target_modules or any(module.endswith(f".{t}") for t in target_modules)


def check_regex(pattern: str, where: str, what: str) -> None:
    """AdapterFileError where ``pattern`` is not a regex both ``re`` (peft's) and ``regex``
    (the time-limited matcher here) compile."""
    try:
        re.compile(pattern)
        regex.compile(pattern)
    except (re.error, regex.error) as e:
        raise AdapterFileError(f"{where}: {what} {pattern!r} is not a valid regex ({e})") from e


def _check_patterns(config: dict, where: str) -> None:
    for name, check in (("rank_pattern", _positive_int), ("alpha_pattern", _finite_real)):
        pattern = config.get(name) or {}
        if not isinstance(pattern, dict):
            raise AdapterFileError(f"{where}: {name} must be an object, got {pattern!r}")
        for key, value in pattern.items():
            check_regex(key, where, f"{name} key")
            check(value, where, f"{name}[{key!r}]")
        config[name] = pattern


def _check_targets(config: dict, where: str) -> None:
    targets = config.get("target_modules")
    ok = targets is None or isinstance(targets, str) or (
        isinstance(targets, list) and all(isinstance(t, str) for t in targets))
    if not ok:
        raise AdapterFileError(f"{where}: target_modules must be a list of names, a regex "
                               f"string or null, got {targets!r}")
    if isinstance(targets, str):
        check_regex(targets, where, "target_modules")


def json_kind(value) -> str:
    """What a JSON value is, in JSON's words: a string, a boolean, a number, null, ..."""
    kinds = ((str, "a string"), (bool, "a boolean"), (numbers.Number, "a number"),
             ((list, tuple), "a list"), (dict, "an object"), (type(None), "null"))
    return next((word for kind, word in kinds if isinstance(value, kind)),
                type(value).__name__)


def _check_flags(config: dict, where: str) -> None:
    """use_rslora, fan_in_fan_out and use_dora are true or false (null: not set, as peft
    reads it). Anything else is refused: the string "false" is truthy, and it turned
    rsLoRA on (a scale of alpha / sqrt(r) where alpha / r was meant)."""
    for field in FLAG_FIELDS:
        value = config.get(field)
        if value is not None and not isinstance(value, bool):
            raise AdapterFileError(f"{where}: {field} must be true or false (a JSON boolean), "
                                   f"got {value!r}, {json_kind(value)}")


def _adapters_inside(folder: Path) -> str:
    """Where ``folder`` holds adapter directories (peft's save_pretrained of
    several adapters writes each but "default" in a folder of its name), how to
    load one of them; else ""."""
    try:
        inside = sorted(d.name for d in folder.iterdir() if (d / CONFIG_NAME).is_file())
    except OSError:
        return ""
    if not inside:
        return ""
    return (f"; {folder} holds the adapters {inside} in folders of their names (peft's "
            f"save_pretrained of several adapters): load_adapter({str(folder / inside[0])!r})")


def _read_config(file: Path) -> dict:
    """adapter_config.json, with the fields the loader honours checked: r,
    lora_alpha, the patterns, target_modules; DoRA and other peft types refused."""
    if not file.is_file():
        raise AdapterFileError(f"{file}: missing; a peft adapter directory holds "
                               f"{CONFIG_NAME} and {WEIGHTS_NAME}{_adapters_inside(file.parent)}")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, an int of 4300+ digits
        raise AdapterFileError(f"{file}: not valid JSON ({e})") from e
    except RecursionError as e:
        raise AdapterFileError(f"{file}: not valid JSON (nested too deeply to read)") from e
    if not isinstance(config, dict):
        raise AdapterFileError(f"{file}: expected a JSON object, got {type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterFileError(f"{file}: peft_type is {config['peft_type']!r}, not 'LORA'")
    _check_flags(config, str(file))
    if config.get("use_dora"):
        raise AdapterFileError(f"{file}: use_dora is true; DoRA adapters are not supported")
    for field, what in (("r", "the LoRA rank"), ("lora_alpha", "the scale's numerator")):
        if field not in config:
            raise AdapterFileError(f"{file}: missing {field!r} ({what})")
    config["r"] = _positive_int(config["r"], str(file), "r")
    config["lora_alpha"] = _finite_real(config["lora_alpha"], str(file), "lora_alpha")
    _check_patterns(config, str(file))
    _check_targets(config, str(file))
    return config


# ---------------------------------------------------------------- peft: tensors

def _reserved_message(name: str, what: str = "key") -> str | None:
    """Why the key (or module) ``name`` is refused (a part of it is reserved), or None."""
    part = next((p for p in name.split(".") if p in RESERVED_NAMES), None)
    if part is None:
        return None
    return (f"{what} {name} holds the name {part!r}; {', '.join(RESERVED_NAMES)} are refused "
            f"in module names (in JavaScript they reach objects every script shares)")


def _refuse_reserved_names(file: Path, keys) -> None:
    for key in keys:
        why = _reserved_message(key)
        if why:
            raise AdapterFileError(f"{file}: {why}")


def _read_tensors(file: Path, dtype=None) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors file, after checking each dtype from the header:
    F32 and F16 as stored, BF16 and F64 as float32, or every one as ``dtype`` if given."""
    if not file.is_file():
        raise AdapterFileError(f"{file}: missing; a peft adapter directory holds "
                               f"{CONFIG_NAME} and {WEIGHTS_NAME}")
    length, header = read_header(file, AdapterFileError)
    try:
        with safe_open(str(file), framework="np") as f:
            _refuse_reserved_names(file, sorted(f.keys()))
            stored = {key: f.get_slice(key).get_dtype() for key in f.keys()}
            for key, name in stored.items():
                if name not in _KEPT_DTYPES and name not in _CONVERTED_DTYPES:
                    raise AdapterFileError(f"{file}: {key} has dtype {name}; "
                                           f"{_DTYPES_EXPECTED}")
            return {key: read_values(file, f, key, length, header,
                                     dtype or _KEPT_DTYPES.get(name, np.float32),
                                     AdapterFileError)
                    for key, name in stored.items()}
    except SafetensorError as e:
        raise AdapterFileError(f"{file}: not a readable safetensors file ({e})") from e


def _split_key(file: Path, key: str) -> tuple[str, str]:
    """``base_model.model.<module>.lora_A[.default].weight`` -> (module, "A")."""
    match = _KEY.fullmatch(key)
    if match is None:
        raise AdapterFileError(f"{file}: unexpected key {key}; only <module>.lora_A.weight "
                               f"and <module>.lora_B.weight are supported")
    return match["module"].removeprefix(PEFT_PREFIX), match["part"]


def _is_extra(file: Path, key: str) -> bool:
    """A tensor beside the LoRA pairs (a modules_to_save head, a bias): True.
    A LoRA tensor of a kind not supported (DoRA's lora_magnitude_vector, an
    embedding's lora_embedding_A) would make the result wrong: refused."""
    if _KEY.fullmatch(key):
        return False
    if ".lora_" in key:
        raise AdapterFileError(f"{file}: unexpected key {key}; only <module>.lora_A.weight "
                               f"and <module>.lora_B.weight are supported (not DoRA's "
                               f"magnitudes or embedding LoRA)")
    return True


def adapter_extras(path) -> dict[str, np.ndarray]:
    """The tensors of a peft adapter directory that are not LoRA pairs, by key
    without peft's ``base_model.model.`` prefix: ``modules_to_save`` copies
    (``classifier.modules_to_save.default.weight`` or ``classifier.weight``)
    and trained biases (``bias="lora_only"`` or ``"all"``), for the caller to
    set in the base model; ``load_adapter`` warns that it leaves them out."""
    file = _adapter_dir(path) / WEIGHTS_NAME
    return {key.removeprefix(PEFT_PREFIX): value for key, value in _read_tensors(file).items()
            if _is_extra(file, key)}


def _pair_keys(file: Path, keys) -> dict[str, dict[str, str]]:
    """{module: {"A": key, "B": key}}: every module needs exactly one of each."""
    pairs: dict[str, dict[str, str]] = {}
    for key in sorted(keys):
        module, part = _split_key(file, key)
        found = pairs.setdefault(module, {})
        if part in found:
            raise AdapterFileError(f"{file}: module {module} has two lora_{part} tensors: "
                                   f"{found[part]} and {key}")
        found[part] = key
    for module, found in pairs.items():
        for part, other in (("A", "B"), ("B", "A")):
            if part not in found:
                raise AdapterFileError(f"{file}: module {module} has {found[other]} but no "
                                       f"lora_{part} tensor")
    if not pairs:
        raise AdapterFileError(f"{file}: holds no LoRA tensors")
    return pairs


def _check_peft_shapes(file: Path, keys: dict, a: np.ndarray, b: np.ndarray, rank: int) -> None:
    if a.ndim != 2 or a.shape[0] != rank:
        raise AdapterFileError(f"{file}: {keys['A']} has shape {tuple(a.shape)}; lora_A "
                               f"must be [r, in] with r = {rank}")
    if b.ndim != 2 or b.shape[1] != rank:
        raise AdapterFileError(f"{file}: {keys['B']} has shape {tuple(b.shape)}; lora_B "
                               f"must be [out, r] with r = {rank}")


def _peft_layer(file: Path, module: str, keys: dict, tensors: dict, config: dict) -> LoraLayer:
    """One module's LoraLayer, with the config's rank and alpha (or their pattern
    overrides) checked against the stored shapes and values."""
    if not target_matches(config.get("target_modules"), module, file):
        raise AdapterFileError(f"{file}: module {module} does not match target_modules "
                               f"{config['target_modules']!r} in {CONFIG_NAME}")
    rank = _pattern_value(config["rank_pattern"], module, config["r"], file, "rank_pattern")
    alpha = _pattern_value(config["alpha_pattern"], module, config["lora_alpha"], file,
                           "alpha_pattern")
    a, b = tensors[keys["A"]], tensors[keys["B"]]
    _check_peft_shapes(file, keys, a, b, rank)
    for part, array in (("A", a), ("B", b)):
        _check_finite(f"{file}: {keys[part]}", array)
    return LoraLayer(a, b, alpha=float(alpha), use_rslora=bool(config.get("use_rslora")),
                     fan_in_fan_out=bool(config.get("fan_in_fan_out")))


def _load_dtype(dtype):
    """load_adapter's ``dtype``: None, or float32/float16 in any spelling numpy takes."""
    if dtype is None:
        return None
    try:
        out = np.dtype(dtype)
    except TypeError:
        out = None
    if out not in (np.float32, np.float16):
        raise AdapterFileError(f"load_adapter: dtype {dtype!r}; None (as stored), float32 or "
                               f"float16 expected")
    return out.type


def load_adapter(path, dtype=None) -> dict[str, LoraLayer]:
    """A peft LoRA adapter directory as ``{module name: LoraLayer}``.

    F32 and F16 tensors are kept as stored, BF16 ones widened to float32 exactly and
    F64 ones narrowed to float32; ``dtype`` (float32 or float16) makes every tensor
    that dtype instead. A finite value beyond the dtype's range is refused, naming it.

    Module names lose peft's ``base_model.model.`` prefix (keys without it are
    accepted too, as some tools write them), and the ``.default`` adapter-name
    infix of some peft versions is accepted. ``r``/``lora_alpha`` (or their
    ``rank_pattern``/``alpha_pattern`` overrides), ``use_rslora`` and
    ``target_modules`` are honoured; ``fan_in_fan_out`` is recorded and does not
    change the shapes (peft's lora_A/lora_B are ``[r, in]``/``[out, r]`` either way).
    Tensors beside the LoRA pairs (``modules_to_save`` heads, trained biases)
    are left out with an :class:`AdapterExtrasWarning` (``adapter_extras``
    returns them); DoRA and other LoRA kinds are refused.
    """
    path = _adapter_dir(path)
    dtype = _load_dtype(dtype)
    config = _read_config(path / CONFIG_NAME)
    file = path / WEIGHTS_NAME
    tensors = _read_tensors(file, dtype)
    extras = [key for key in sorted(tensors) if _is_extra(file, key)]
    if extras:
        shown = ", ".join(extras[:4]) + (f", … ({len(extras)} in all)" if len(extras) > 4 else "")
        warnings.warn(AdapterExtrasWarning(
            f"{file}: {len(extras)} tensor(s) beside the LoRA pairs are not applied: {shown} "
            f"(modules_to_save={config.get('modules_to_save')!r}, bias="
            f"{config.get('bias', 'none')!r}); lora.adapter_extras(path) returns them, to set "
            f"in the base model"), stacklevel=2)
    pairs = _pair_keys(file, [key for key in tensors if key not in extras])
    return {module: _peft_layer(file, module, keys, tensors, config)
            for module, keys in pairs.items()}


def _adapter_dir(path) -> Path:
    """``path`` as a peft adapter directory, or AdapterFileError saying what it is."""
    path = Path(path)
    if path.is_file() and path.name == WEIGHTS_NAME:
        raise AdapterFileError(f"{path}: load_adapter takes the adapter's directory (with "
                               f"{CONFIG_NAME} beside {WEIGHTS_NAME}), not the tensors file: "
                               f"load_adapter({str(path.parent)!r})")
    if not path.is_dir():
        raise AdapterFileError(f"{path}: no such adapter directory" +
                               (" (a file: load_adapter takes the adapter's directory)"
                                if path.is_file() else ""))
    return path


# ---------------------------------------------------------------- peft: saving

def _peft_tensors(path: Path, layers: dict) -> tuple[dict, dict[str, int]]:
    """The safetensors dict peft writes, and each module's rank."""
    if not isinstance(layers, dict) or not layers:
        raise AdapterFileError(f"{path}: layers must be a non-empty dict {{module: (A, B)}}")
    tensors, ranks = {}, {}
    for module, value in layers.items():
        where = f"{path}: module {module}"
        if not isinstance(module, str) or not all(module.split(".")) or \
                module.startswith(PEFT_PREFIX):
            raise AdapterFileError(f"{where}: module names are dotted names without "
                                   f"{PEFT_PREFIX!r}, e.g. 'model.layers.0.self_attn.q_proj'")
        reserved = _reserved_message(module, "module")
        if reserved:
            raise AdapterFileError(f"{path}: {reserved}")
        a, b = _host_pair(where, value)
        ranks[module] = a.shape[0]
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b
    return tensors, ranks


def _alphas(path: Path, layers: dict, alpha) -> dict[str, float]:
    """Each module's alpha: ``alpha`` one number for all, or ``{module: number}`` for each."""
    if not isinstance(alpha, dict):
        value = _finite_real(alpha, str(path), "alpha")
        return {module: value for module in layers}
    if set(alpha) != set(layers):
        raise AdapterFileError(f"{path}: alpha as a dict must name every module of layers and "
                               f"no other; missing {sorted(set(layers) - set(alpha))}, extra "
                               f"{sorted(set(alpha) - set(layers), key=str)}")
    return {module: _finite_real(alpha[module], str(path), f"alpha[{module!r}]")
            for module in layers}


def _most_common(values: dict):
    """The value most modules have (the largest on a tie): the config's r or lora_alpha."""
    counts = Counter(values.values())
    return max(counts, key=lambda value: (counts[value], value))


def _pattern(values: dict, default) -> dict:
    """peft's rank_pattern or alpha_pattern for ``values`` ({module: value}): the escaped
    name of each module whose value is not ``default``, longest first. peft takes the
    first key matching a dotted suffix of a module's name, so a module's own key comes
    before any shorter key that matches it too, and a module of the default value that
    another module's key would match gets its own key."""
    keyed = {module for module, value in values.items() if value != default}
    caught = True
    while caught:
        caught = {module for module in values if module not in keyed
                  and any(module.endswith(f".{other}") for other in keyed)}
        keyed |= caught
    return {re.escape(module): values[module]
            for module in sorted(keyed, key=lambda module: (-len(module), module))}


def _peft_config(ranks: dict, alphas: dict, rank, target_modules, use_rslora: bool,
                 fan_in_fan_out: bool, base_model_name_or_path, task_type) -> dict:
    """The adapter_config.json fields peft's LoraConfig writes that matter here: r and
    lora_alpha the most common values (or ``rank``), the others in the patterns."""
    r = _most_common(ranks) if rank is None else rank
    lora_alpha = _most_common(alphas)
    config = {"peft_type": "LORA", "task_type": task_type, "r": r, "lora_alpha": lora_alpha,
              "target_modules": target_modules, "use_rslora": bool(use_rslora),
              "fan_in_fan_out": bool(fan_in_fan_out), "lora_dropout": 0.0, "bias": "none",
              "init_lora_weights": True, "inference_mode": True, "use_dora": False,
              "base_model_name_or_path": base_model_name_or_path, "modules_to_save": None,
              "revision": None, "layers_to_transform": None, "layers_pattern": None,
              "rank_pattern": _pattern(ranks, r), "alpha_pattern": _pattern(alphas, lora_alpha)}
    return dict(sorted(config.items()))  # the patterns keep their order: it is their meaning


def _target_list(path: Path, layers: dict, target_modules):
    """target_modules as peft stores it (the sorted last components by default),
    checked so that the file written is one load_adapter accepts."""
    if target_modules is None:
        return sorted({module.rpartition(".")[2] for module in layers})
    if not isinstance(target_modules, str):
        target_modules = sorted(set(target_modules))
    for module in layers:
        if not target_matches(target_modules, module, path):
            raise AdapterFileError(f"{path}: module {module} does not match target_modules "
                                   f"{target_modules!r}")
    return target_modules


def _save_options(path: Path, lora_dropout, use_rslora, fan_in_fan_out, task_type,
                  base_model_name_or_path) -> None:
    """save_adapter's options, each refused by name where peft would read it otherwise."""
    if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, numbers.Real) or \
            not 0 <= float(lora_dropout) < 1:
        raise AdapterFileError(f"{path}: lora_dropout must be a probability in [0, 1), got "
                               f"{lora_dropout!r}")
    for name, value in (("use_rslora", use_rslora), ("fan_in_fan_out", fan_in_fan_out)):
        if not isinstance(value, (bool, np.bool_)):
            raise AdapterFileError(f"{path}: {name} must be True or False, got {value!r}")
    if task_type is not None and task_type not in PEFT_TASK_TYPES:
        raise AdapterFileError(f"{path}: task_type must be None or one of peft's "
                               f"{PEFT_TASK_TYPES}, got {task_type!r}")
    if base_model_name_or_path is not None and not isinstance(base_model_name_or_path, str):
        raise AdapterFileError(f"{path}: base_model_name_or_path must be a str or None, got "
                               f"{base_model_name_or_path!r}")


def save_adapter(path, layers, *, alpha, rank=None, target_modules=None, use_rslora=False,
                 fan_in_fan_out=False, base_model_name_or_path=None,
                 lora_dropout=0.0, task_type=None) -> Path:
    """Write ``{module: (A [r, in], B [out, r])}`` as a peft adapter directory
    (created if missing): adapter_config.json and adapter_model.safetensors.

    Arrays are stored as float32, or float16 when they are float16; every
    shape, dtype and value is checked before anything is written, and both files
    are written under temporary names and renamed into place. ``alpha`` is one
    number or ``{module: number}``. Modules may differ in rank and alpha: the config's
    ``r`` (``rank`` if given) and ``lora_alpha`` are the most common values, and the
    other modules are named in ``rank_pattern`` and ``alpha_pattern``, as peft writes them.
    ``lora_dropout``: the config's (what peft applies when it trains the adapter on).
    ``task_type``: peft's (``"CAUSAL_LM"`` for a language model: PeftModel.from_pretrained
    then makes a PeftModelForCausalLM); ``base_model_name_or_path``: the base model's
    folder or hub name, where known.
    """
    path = Path(path)
    _save_options(path, lora_dropout, use_rslora, fan_in_fan_out, task_type,
                  base_model_name_or_path)
    if rank is not None:
        rank = _positive_int(rank, str(path), "rank")
    tensors, ranks = _peft_tensors(path, layers)
    alphas = _alphas(path, layers, alpha)
    targets = _target_list(path, layers, target_modules)
    config = _peft_config(ranks, alphas, rank, targets, bool(use_rslora), bool(fan_in_fan_out),
                          base_model_name_or_path, task_type)
    config["lora_dropout"] = float(lora_dropout)
    text = json.dumps(config, indent=2) + "\n"
    path.mkdir(parents=True, exist_ok=True)
    _commit({path / WEIGHTS_NAME: lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}),
             path / CONFIG_NAME: lambda tmp: tmp.write_text(text, encoding="utf-8")})
    return path


# ---------------------------------------------------------------- Hesper

def _hesper_names(count: int) -> list[str]:
    return [f"layers.{i}.{part}" for i in range(count) for part in _HESPER_PARTS]


def _hesper_shapes(rank: int, dim: int, kv_dim: int) -> dict[str, tuple]:
    """The (A, B) shapes of a layer's q and v adapters, in the file's order."""
    return {"q": ((rank, dim), (dim, rank)), "v": ((rank, dim), (kv_dim, rank))}


def _hesper_pairs(path: Path, layers: dict, rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (A, B) pairs in file order, after checking the dict is Hesper's layout:
    layers.0.q, layers.0.v, ... with one dim and one kv_dim throughout."""
    count = len(layers) // 2 if isinstance(layers, dict) else 0
    if not count or sorted(layers) != sorted(_hesper_names(count)):
        got = sorted(layers) if isinstance(layers, dict) else type(layers).__name__
        raise AdapterFileError(f"{path}: Hesper's format holds layers.{{i}}.q and "
                               f"layers.{{i}}.v for i = 0..n-1 and nothing else, got {got}")
    pairs = [_host_pair(f"{path}: module {n}", layers[n]) for n in _hesper_names(count)]
    dim, kv_dim = pairs[0][0].shape[1], pairs[1][1].shape[0]
    expected = _hesper_shapes(rank, dim, kv_dim)
    for name, (a, b) in zip(_hesper_names(count), pairs):
        want = expected[name[-1]]
        if (a.shape, b.shape) != want:
            raise AdapterFileError(f"{path}: module {name}: A {a.shape} and B {b.shape}, but "
                                   f"Hesper's layout with rank {rank}, dim {dim} and kv_dim "
                                   f"{kv_dim} needs A {want[0]} and B {want[1]}")
    return pairs


def save_hesper(path, layers, *, rank, alpha) -> Path:
    """Write ``{"layers.{i}.q": (A, B), "layers.{i}.v": (A, B)}`` as Hesper's binary
    LoRA file: a 24-byte header, then each layer's Q_A, Q_B, V_A, V_B as
    little-endian float32 (float16 input is widened, exactly)."""
    path = Path(path)
    rank = _positive_int(rank, str(path), "rank")
    alpha = _finite_real(alpha, str(path), "alpha")
    if not math.isfinite(np.float32(alpha)):
        raise AdapterFileError(f"{path}: alpha {alpha!r} overflows the header's float32")
    pairs = _hesper_pairs(path, layers, rank)
    header = HESPER_HEADER.pack(HESPER_MAGIC, HESPER_VERSION, rank, alpha, len(pairs) // 2, 0)
    body = b"".join(m.astype("<f4").tobytes() for pair in pairs for m in pair)
    _commit({path: lambda tmp: tmp.write_bytes(header + body)})
    return path


def _hesper_header(path: Path, data: bytes) -> tuple[int, float, int]:
    """(rank, alpha, numLayers) from the header; reserved is ignored, as Hesper does."""
    if len(data) < HESPER_HEADER.size:
        raise AdapterFileError(f"{path}: {len(data)} bytes, shorter than the "
                               f"{HESPER_HEADER.size}-byte Hesper LoRA header")
    magic, version, rank, alpha, count, _reserved = HESPER_HEADER.unpack_from(data)
    if magic != HESPER_MAGIC:
        raise AdapterFileError(f"{path}: magic 0x{magic:08X}, not Hesper's 0x{HESPER_MAGIC:08X} "
                               f"('LORA'); not a Hesper LoRA file")
    if version != HESPER_VERSION:
        raise AdapterFileError(f"{path}: version {version}; only version {HESPER_VERSION} "
                               f"is supported")
    if rank < 1 or count < 1:
        raise AdapterFileError(f"{path}: header says rank {rank} and {count} layers; "
                               f"both must be >= 1")
    return rank, _finite_real(alpha, str(path), "alpha in the header"), count


def _hesper_size_check(path: Path, size: int, expected: int, count: int, dims: str) -> None:
    if size < expected:
        raise AdapterFileError(f"{path}: truncated: {size} bytes, but the header's "
                               f"numLayers {count} at {dims} needs {expected}")
    if size > expected:
        raise AdapterFileError(f"{path}: {size - expected} extra bytes after the header's "
                               f"numLayers {count} ({expected} bytes at {dims}); "
                               f"are dim and kv_dim right?")


def load_hesper(path, dim, kv_dim) -> dict[str, LoraLayer]:
    """Hesper's binary LoRA file as ``{"layers.{i}.q": LoraLayer, "layers.{i}.v": ...}``.

    The file does not hold the model's dims, so the caller gives them: Q maps
    ``dim -> dim``, V maps ``dim -> kv_dim``. The file's size must be exactly
    what the header and dims say, which catches wrong dims as well as truncation.
    """
    path = Path(path)
    dim = _positive_int(dim, str(path), "dim")
    kv_dim = _positive_int(kv_dim, str(path), "kv_dim")
    if not path.is_file():
        raise AdapterFileError(f"{path}: no such Hesper LoRA file")
    with open(path, "rb") as f:  # the size is checked against the header before reading on
        rank, alpha, count = _hesper_header(path, f.read(HESPER_HEADER.size))
        shapes = _hesper_shapes(rank, dim, kv_dim)
        per_layer = sum(math.prod(s) for part in shapes.values() for s in part)
        _hesper_size_check(path, path.stat().st_size, HESPER_HEADER.size + 4 * per_layer * count,
                           count, f"rank {rank}, dim {dim}, kv_dim {kv_dim}")
        data = f.read()
    values = np.frombuffer(data, "<f4").astype(np.float32)
    out, at = {}, 0
    for name in _hesper_names(count):
        pair = []
        for part, shape in zip("AB", shapes[name[-1]]):
            pair.append(values[at:at + math.prod(shape)].reshape(shape))
            at += math.prod(shape)
            _check_finite(f"{path}: {name}.lora_{part}", pair[-1])
        out[name] = LoraLayer(pair[0], pair[1], alpha=alpha)
    return out
