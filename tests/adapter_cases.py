"""One table of good and bad peft adapter files, read by both readers: Python's
``lora.load_adapter`` (tests/test_adapter_io.py) and the page's ``readPeftAdapter``
(lora/apps/web_assets/adapter.mjs, in Node by tests/test_adapter_js.py and in
Chromium by tests/test_export.py). Each case is accepted with the same layers by
both, or refused by both with a message holding the same fragment.

``RUN_CASES_JS`` is the JavaScript that reads the cases (in Node and in a page alike):
after each file it checks that no object but the reader's result changed (the
prototypes every script shares) and that a good adapter still reads.
"""
from __future__ import annotations

import base64
import json
import math
import struct
from dataclasses import dataclass

import numpy as np

MODULE = "model.layers.0.self_attn.q_proj"
KEY_A = f"base_model.model.{MODULE}.lora_A.weight"
KEY_B = f"base_model.model.{MODULE}.lora_B.weight"
RESERVED = "__proto__, constructor, prototype are refused in module names"


@dataclass(frozen=True)
class AdapterCase:
    """A peft adapter's two files and what both readers make of them: ``layers``
    ({module: [rank, in_dim, out_dim, scale]}) when accepted, else ``refused``, a
    fragment of the AdapterFileError's message; ``values`` ({module: [A's values, B's
    values]}, row-major, as float32) where the case checks the values read."""

    name: str
    config: str
    tensors: bytes
    layers: dict | None = None
    refused: str | None = None
    values: dict | None = None

    def as_js(self) -> list[str]:
        """[name, config text, tensors as base64]: what RUN_CASES_JS takes."""
        return [self.name, self.config, base64.b64encode(self.tensors).decode()]


def config(**fields) -> str:
    return json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, **fields})


def raw_safetensors(entries: list[tuple[str, str, list, bytes]], metadata=None,
                    header_text=None) -> bytes:
    """A safetensors file by hand from (key, dtype, shape, bytes) entries (numpy has no
    bfloat16 and safetensors writes no duplicate keys): u64 length, JSON header, data.
    ``header_text`` rewrites the header's JSON text before it is written."""
    header, data = {"__metadata__": metadata or {"format": "pt"}}, b""
    for key, dtype, shape, raw in entries:
        header[key] = {"dtype": dtype, "shape": shape,
                       "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header)
    text = header_text(text) if header_text else text
    text += " " * (-len(text) % 8)
    return struct.pack("<Q", len(text.encode())) + text.encode() + data


def pair_entries(module=MODULE, prefix="base_model.model.", rank=2, dtype: type = np.float32,
                 b_values=None) -> list[tuple[str, str, list, bytes]]:
    """One module's lora_A [rank, 3] and lora_B [5, rank] as safetensors entries."""
    a = (np.arange(rank * 3) * 0.25).reshape(rank, 3).astype(dtype)
    b = (np.arange(5 * rank) * -0.5 if b_values is None else np.asarray(b_values))
    b = b.reshape(5, rank).astype(dtype)
    name = "F32" if np.dtype(dtype) == np.float32 else "F16"
    return [(f"{prefix}{module}.lora_A.weight", name, list(a.shape), a.tobytes()),
            (f"{prefix}{module}.lora_B.weight", name, list(b.shape), b.tobytes())]


GOOD = raw_safetensors(pair_entries())
ACCEPTED = {MODULE: [2, 3, 5, 2.0]}


def _duplicate(text: str) -> str:
    """The header's text with KEY_A's entry named a second time."""
    entry = json.dumps(json.loads(text)[KEY_A])
    return text[:-1] + f", {json.dumps(KEY_A)}: {entry}}}"


def _hostile_cases() -> list[AdapterCase]:
    """Keys and configs that would reach Object.prototype or Object in a page."""
    out = []
    for part in ("__proto__", "constructor", "prototype"):
        out.append(AdapterCase(f"module {part}", config(), raw_safetensors(
            pair_entries(module=part)), refused=f"key base_model.model.{part}.lora_A.weight "
                                                f"holds the name '{part}'; {RESERVED}"))
        out.append(AdapterCase(f"inner {part}", config(), raw_safetensors(
            pair_entries(module=f"model.{part}.q_proj", prefix="")),
            refused=f"key model.{part}.q_proj.lora_A.weight holds the name '{part}'"))
    out.append(AdapterCase("a tensor named __proto__", config(), raw_safetensors(
        pair_entries() + [("__proto__", "F32", [1], bytes(4))]),
        refused=f"key __proto__ holds the name '__proto__'; {RESERVED}"))
    out.append(AdapterCase("config naming __proto__", config(__proto__={"A": "x"},
                                                             constructor={"prototype": 1}),
                           GOOD, layers=ACCEPTED))
    out.append(AdapterCase("metadata naming __proto__", config(), raw_safetensors(
        pair_entries(), metadata={"__proto__": "x", "format": "pt"}), layers=ACCEPTED))
    return out


def _header_cases() -> list[AdapterCase]:
    """Broken safetensors files: duplicates, truncation, dtypes, offsets."""
    return [
        AdapterCase("duplicate header key", config(), raw_safetensors(
            pair_entries(), header_text=_duplicate),
            refused=f"the header names '{KEY_A}' twice (duplicate keys are not allowed in "
                    f"safetensors)"),
        AdapterCase("duplicate key inside an entry", config(), raw_safetensors(
            pair_entries(), header_text=lambda t: t.replace('"dtype": "F32"',
                                                            '"dtype": "F32", "dtype": "F32"', 1)),
            refused="the header names 'dtype' twice"),
        AdapterCase("truncated", config(), GOOD[:-7], refused="not a readable safetensors file"),
        AdapterCase("data_offsets not a list", config(), raw_safetensors(
            pair_entries(), header_text=lambda t: t.replace('"data_offsets": [0, 24]',
                                                            '"data_offsets": 5')),
            refused="not a readable safetensors file"),
        AdapterCase("I32", config(), raw_safetensors(
            [(KEY_A, "I32", [2, 3], bytes(24))] + pair_entries()[1:]),
            refused=f"{KEY_A} has dtype I32; F32, F16, BF16 or F64 expected"),
    ]


# Values a bfloat16 holds exactly (a float32 whose low 16 bits are zero), over its range:
# beyond float16's 65504, a float32 subnormal, signs, zero.
BF16_A = np.array([[1.0, -2.5, 2.0 ** 100], [2.0 ** -130, 0.0, -(2.0 ** -20)]], np.float32)
# Values float32 rounds (0.1, 1/3), its largest finite, and -0.0: F64's narrowing.
F64_B = np.array([0.1, 1 / 3, -7.0, float(np.finfo(np.float32).max), -0.0, 1e-3, 2.0, 3.0,
                  -1e30, 5.0]).reshape(5, 2)


def bf16_bytes(values: np.ndarray) -> bytes:
    """float32 values a bfloat16 holds exactly, as bfloat16's little-endian bytes."""
    bits = values.astype(np.float32).view(np.uint32)
    assert not (bits & 0xFFFF).any(), "not a bfloat16 value"
    return (bits >> 16).astype("<u2").tobytes()


def _dtype_cases() -> list[AdapterCase]:
    """BF16 widened and F64 narrowed to float32; F64 refused where a value does not fit."""
    f32_a, f32_b = pair_entries()
    beyond = F64_B.copy()
    beyond[1, 1], beyond[3, 0] = 1e39, -4e38
    nonfinite = F64_B.copy()
    nonfinite[0] = [np.inf, np.nan]
    inf_bf16 = BF16_A.copy()
    inf_bf16[0, 0] = np.inf
    read = {MODULE: [BF16_A.ravel().tolist(), np.frombuffer(f32_b[3], np.float32).tolist()]}
    return [
        AdapterCase("BF16", config(), raw_safetensors(
            [(KEY_A, "BF16", [2, 3], bf16_bytes(BF16_A)), f32_b]),
            layers=ACCEPTED, values=read),
        AdapterCase("F64", config(), raw_safetensors(
            [f32_a, (KEY_B, "F64", [5, 2], F64_B.tobytes())]), layers=ACCEPTED,
            values={MODULE: [np.frombuffer(f32_a[3], np.float32).tolist(),
                             F64_B.astype(np.float32).ravel().tolist()]}),
        AdapterCase("F64 beyond float32", config(), raw_safetensors(
            [f32_a, (KEY_B, "F64", [5, 2], beyond.tobytes())]),
            refused=f"{KEY_B} holds 1e+39, which does not fit float32 (largest finite "
                    f"3.4028234663852886e+38); 2 of 10 values are beyond it"),
        AdapterCase("F64 NaN and inf", config(), raw_safetensors(
            [f32_a, (KEY_B, "F64", [5, 2], nonfinite.tobytes())]),
            refused=f"{KEY_B}: 2 of 10 values are NaN or infinite"),
        AdapterCase("BF16 inf", config(), raw_safetensors(
            [(KEY_A, "BF16", [2, 3], bf16_bytes(inf_bf16)), f32_b]),
            refused=f"{KEY_A}: 1 of 6 values are NaN or infinite"),
    ]


def _config_cases() -> list[AdapterCase]:
    return [
        AdapterCase("bad JSON", "{r: 2", GOOD, refused="adapter_config.json: not valid JSON"),
        AdapterCase("not an object", "[2]", GOOD, refused="expected a JSON object"),
        AdapterCase("r 2.0", config(r=2.0), GOOD, refused="r must be an int >= 1, got 2.0"),
        AdapterCase("r as text", config(r="2"), GOOD, refused="r must be an int >= 1, got"),
        AdapterCase("r 0", config(r=0), GOOD, refused="r must be an int >= 1, got 0"),
        AdapterCase("no r", json.dumps({"lora_alpha": 4}), GOOD,
                    refused="missing 'r' (the LoRA rank)"),
        AdapterCase("alpha as text", config(lora_alpha="4"), GOOD,
                    refused="lora_alpha must be a finite number"),
        AdapterCase("DoRA", config(use_dora=True), GOOD,
                    refused="use_dora is true; DoRA adapters are not supported"),
        AdapterCase("IA3", config(peft_type="IA3"), GOOD, refused="not 'LORA'"),
        AdapterCase("rsLoRA", config(r=2, lora_alpha=4, use_rslora=True), GOOD,
                    layers={MODULE: [2, 3, 5, 4 / math.sqrt(2)]}),
        # a string is truthy: "false" turned rsLoRA on (scale 2.83 where 2.0 was meant)
        AdapterCase("use_rslora as text", config(use_rslora="false"), GOOD,
                    refused="use_rslora must be true or false (a JSON boolean), got 'false', "
                            "a string"),
        AdapterCase("fan_in_fan_out 1", config(fan_in_fan_out=1), GOOD,
                    refused="fan_in_fan_out must be true or false (a JSON boolean), got 1, "
                            "a number"),
        AdapterCase("use_dora as a list", config(use_dora=[]), GOOD,
                    refused="use_dora must be true or false (a JSON boolean), got [], a list"),
        AdapterCase("switches null", config(use_rslora=None, use_dora=None,
                                            fan_in_fan_out=None), GOOD, layers=ACCEPTED),
    ]


def _target_cases() -> list[AdapterCase]:
    """peft's target_modules rule: list entries are names or dotted suffixes; a string
    is a regex matching the whole name."""
    mismatch = f"module {MODULE} does not match target_modules"
    targets = {"list of last parts": (["q_proj", "v_proj"], None),
               "list of dotted suffixes": (["self_attn.q_proj"], None),
               "list of whole names": ([MODULE], None),
               "all-linear": ("all-linear", None),
               "regex": (r".*\.q_proj", None),
               "regex with |": (r"x|.*\.q_proj", None),
               "list mismatch": (["v_proj", "elf_attn.q_proj"], mismatch),
               "regex mismatch": (r".*\.v_proj", mismatch),
               "regex matching a part only": ("q_proj", mismatch),
               "target_modules a number": (5, "target_modules must be a list of names, a "
                                              "regex string or null"),
               "regex not valid": ("(q", "target_modules '(q' is not a valid regex")}
    return [AdapterCase(f"target_modules: {name}", config(target_modules=value), GOOD,
                        layers=None if refused else ACCEPTED, refused=refused)
            for name, (value, refused) in targets.items()]


def _pattern_cases() -> list[AdapterCase]:
    """peft's rank_pattern and alpha_pattern: the first key (in the file's order) that
    matches a dotted suffix of the module name overrides r or lora_alpha."""
    layer0 = "model.layers.0"
    good = {"rank_pattern sets the rank": (config(r=4, rank_pattern={"q_proj": 2}), ACCEPTED),
            "first matching key wins": (config(r=4, rank_pattern={r"self_attn\.q_proj": 2,
                                                                 "q_proj": 3}), ACCEPTED),
            "a key that is not a dotted suffix": (config(rank_pattern={r"attn\.q_proj": 3}),
                                                  ACCEPTED),
            "alpha_pattern sets the alpha": (config(alpha_pattern={"q_proj": 8}),
                                             {MODULE: [2, 3, 5, 4.0]}),
            "alpha_pattern with rsLoRA": (config(alpha_pattern={"self_attn.q_proj": 3},
                                                 use_rslora=True),
                                          {MODULE: [2, 3, 5, 3 / math.sqrt(2)]}),
            "patterns null and []": (config(rank_pattern=None, alpha_pattern=[]), ACCEPTED)}
    bad = {"first matching key wins, refused": ({"q_proj": 3, r"self_attn\.q_proj": 2},
                                                f"{KEY_A} has shape (2, 3); lora_A must be "
                                                f"[r, in] with r = 3"),
           "rank_pattern a list": ([1], "adapter_config.json: rank_pattern must be an object, "
                                        "got [1]"),
           "rank_pattern 2.0": ({"q_proj": 2.0},
                                "rank_pattern['q_proj'] must be an int >= 1, got 2.0"),
           "rank_pattern true": ({"q_proj": True},
                                 "rank_pattern['q_proj'] must be an int >= 1, got True"),
           "rank_pattern 0, escaped key": ({r"self_attn\.q_proj": 0}, r"rank_pattern["
                                           r"'self_attn\\.q_proj'] must be an int >= 1, got 0"),
           "rank_pattern key not a regex": ({"(q": 2}, "rank_pattern key '(q' is not a valid "
                                                       "regex")}
    out = [AdapterCase(name, text, GOOD, layers=layers) for name, (text, layers) in good.items()]
    out += [AdapterCase(name, config(r=4, rank_pattern=value), GOOD, refused=refused)
            for name, (value, refused) in bad.items()]
    return out + [
        AdapterCase("integer-like key keeps its place", config(
            r=4, rank_pattern={r"layers\.0": 2, "0": 3}), raw_safetensors(
            pair_entries(module=layer0)), layers={layer0: [2, 3, 5, 2.0]}),
        AdapterCase("alpha_pattern text", config(alpha_pattern={"q_proj": "4"}), GOOD,
                    refused="alpha_pattern['q_proj'] must be a finite number, got '4'"),
        AdapterCase("alpha_pattern null value", config(alpha_pattern={"q_proj": None}), GOOD,
                    refused="alpha_pattern['q_proj'] must be a finite number, got None"),
        AdapterCase("alpha_pattern a string", config(alpha_pattern="x"), GOOD,
                    refused="alpha_pattern must be an object, got 'x'"),
    ]


def _tensor_cases() -> list[AdapterCase]:
    nan = np.arange(10.0)
    nan[[1, 4]] = [np.nan, np.inf]
    wide = pair_entries(rank=3)[:1] + pair_entries()[1:]
    default = pair_entries() + [(f"base_model.model.{MODULE}.lora_A.default.weight", "F32",
                                 [2, 3], bytes(24))]
    return [
        AdapterCase("good f32", config(), GOOD, layers=ACCEPTED),
        AdapterCase("good f16", config(), raw_safetensors(pair_entries(dtype=np.float16)),
                    layers=ACCEPTED),
        AdapterCase("keys without the prefix", config(), raw_safetensors(
            pair_entries(prefix="")), layers=ACCEPTED),
        AdapterCase("missing B", config(), raw_safetensors(pair_entries()[:1]),
                    refused=f"module {MODULE} has {KEY_A} but no lora_B tensor"),
        AdapterCase("two lora_A", config(), raw_safetensors(default),
                    refused=f"module {MODULE} has two lora_A tensors"),
        AdapterCase("NaN", config(), raw_safetensors(pair_entries(b_values=nan)),
                    refused=f"{KEY_B}: 2 of 10 values are NaN or infinite"),
        AdapterCase("A rows not r", config(), raw_safetensors(wide),
                    refused=f"{KEY_A} has shape"),
        AdapterCase("DoRA magnitudes", config(), raw_safetensors(pair_entries() + [(
            f"base_model.model.{MODULE}.lora_magnitude_vector", "F32", [5], bytes(20))]),
            refused="lora_magnitude_vector; only <module>.lora_A.weight and "
                    "<module>.lora_B.weight are supported"),
        AdapterCase("no LoRA tensors", config(), raw_safetensors(
            [("base_model.model.classifier.weight", "F32", [2], bytes(8))]),
            refused="holds no LoRA tensors"),
    ]


CASES = (_tensor_cases() + _dtype_cases() + _config_cases() + _pattern_cases()
         + _target_cases() + _header_cases() + _hostile_cases())


def check_outcome(case: AdapterCase, outcome: dict, reader: str) -> None:
    """``outcome`` ({"layers": ...} or {"refused": message}) is what ``case`` expects."""
    if case.refused is None:
        assert "layers" in outcome, f"{reader} refused {case.name}: {outcome}"
        want_layers = case.layers or {}
        assert outcome["layers"].keys() == want_layers.keys(), (case.name, outcome)
        for module, want in want_layers.items():
            assert outcome["layers"][module] == list(want), (reader, case.name, outcome)
        for module, want in (case.values or {}).items():
            assert outcome["values"][module] == want, (reader, case.name, outcome["values"])
    else:
        assert "refused" in outcome, f"{reader} accepted {case.name}: {outcome}"
        assert case.refused in outcome["refused"], (reader, case.name, outcome["refused"])


# ``run(m, cases)``: each case read by module m's readPeftAdapter, as {name: {layers} or
# {refused}}; "changed" lists what a file changed outside its result, "good" whether the
# good f32 case still read after each file.
RUN_CASES_JS = r"""
const shared = {"Object.prototype": Object.prototype, "Object": Object,
                "Array.prototype": Array.prototype, "Function.prototype": Function.prototype};
const snapshot = () => new Map(Object.entries(shared).flatMap(([n, o]) => Reflect.ownKeys(o)
  .map(k => [`${n}.${String(k)}`, Object.getOwnPropertyDescriptor(o, k).value])));
const changes = before => {
  const now = snapshot();
  return [...new Set([...before.keys(), ...now.keys()])].filter(
    k => !before.has(k) || !now.has(k) || before.get(k) !== now.get(k));
};
const bytesOf = text => Uint8Array.from(atob(text), c => c.charCodeAt(0));
const read = (m, config, bytes) => {
  try {
    const {layers} = m.readPeftAdapter(config, bytesOf(bytes)), out = {}, values = {};
    for (const [module, l] of Object.entries(layers)) {
      out[module] = [l.rank, l.inDim, l.outDim, l.scale];
      values[module] = [Array.from(l.a), Array.from(l.b)];
    }
    return {layers: out, values};
  } catch (e) { return {refused: `${e.name}: ${e.message}`}; }
};
const run = (m, cases) => {
  const before = snapshot(), out = {}, good = cases.find(c => c[0] === "good f32");
  for (const [name, config, bytes] of cases) {
    out[name] = read(m, config, bytes);
    out[name].changed = changes(before);
    out[name].good = "layers" in read(m, good[1], good[2]);
    out[name].plainObjectA = ({}).A ?? null;
  }
  return out;
};
"""
