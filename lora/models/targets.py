"""peft's ``target_modules`` for a causal LM: which modules a LoraConfig wraps, read as
peft 0.22 reads it (tuners_utils.check_target_module_exists and
_maybe_include_all_linear_layers), over the modules of transformers' model.

    resolve_targets(["q_proj", "v_proj"], lm_modules(config))
    # ['model.layers.0.self_attn.q_proj', 'model.layers.0.self_attn.v_proj', ...]

A list names a module whose name is an entry or ends with "." + an entry; a string is
a regex that must match a whole name (re.fullmatch); "all-linear" (any case) is every
Linear but the output layer (lm_head); None is peft's default for Llama and Qwen2,
["q_proj", "v_proj"]. peft matches every module, not only Linear ones: a target naming
another kind (an MLP block, the embedding, which peft would adapt) is refused here.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..training.adapter_io import AdapterFileError, check_regex, target_matches
from .checks import ModelError
from .config import LMConfig, linear_modules

LINEAR = "Linear"
OUTPUT_LAYER = "lm_head"   # peft's all-linear leaves out model.get_output_embeddings()
ALL_LINEAR = "all-linear"
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")  # peft's default for llama and qwen2


def lm_modules(config: LMConfig) -> dict[str, str]:
    """Every module of transformers' causal LM for ``config`` (named_modules, the root
    left out), in its order, with its class's name."""
    arch = {"llama": "Llama", "qwen2": "Qwen2"}[config.model_type]
    out = {"model": f"{arch}Model", "model.embed_tokens": "Embedding",
           "model.layers": "ModuleList"}
    linears = linear_modules(config)
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        out[layer] = f"{arch}DecoderLayer"
        out[f"{layer}.self_attn"] = f"{arch}Attention"
        out.update({f"{layer}.self_attn.{p}": LINEAR for p in ("q_proj", "k_proj", "v_proj",
                                                               "o_proj")})
        out[f"{layer}.mlp"] = f"{arch}MLP"
        out.update({f"{layer}.mlp.{p}": LINEAR for p in ("gate_proj", "up_proj", "down_proj")})
        out[f"{layer}.mlp.act_fn"] = "SiLUActivation"
        out[f"{layer}.input_layernorm"] = f"{arch}RMSNorm"
        out[f"{layer}.post_attention_layernorm"] = f"{arch}RMSNorm"
    out.update({"model.norm": f"{arch}RMSNorm", "model.rotary_emb": f"{arch}RotaryEmbedding",
                OUTPUT_LAYER: LINEAR})
    assert {name for name, kind in out.items() if kind == LINEAR} == set(linears)
    return out


def _short_names(modules: Mapping[str, str]) -> list[str]:
    """The Linear layers' last name parts, each once, in the model's order."""
    return list(dict.fromkeys(n.rpartition(".")[2] for n, k in modules.items() if k == LINEAR))


def _matches(target_modules, modules: Mapping[str, str]) -> list[str]:
    """The modules peft's rule picks (any kind), in the model's order."""
    if isinstance(target_modules, str) and target_modules.lower() == ALL_LINEAR:
        return [n for n, kind in modules.items() if kind == LINEAR and n != OUTPUT_LAYER]
    try:
        if isinstance(target_modules, str):
            check_regex(target_modules, "resolve_targets", "target_modules")
        return [n for n in modules if target_matches(target_modules, n, "resolve_targets")]
    except AdapterFileError as e:
        raise ModelError(str(e)) from None


def _checked(target_modules):
    """target_modules as peft takes it: a str, a collection of non-empty str, or None."""
    if target_modules is None:
        return list(PEFT_DEFAULT_TARGETS)
    if isinstance(target_modules, str):
        return target_modules
    entries = list(target_modules) if isinstance(target_modules, (list, tuple, set,
                                                                  frozenset)) else None
    if entries is None or not all(isinstance(t, str) and t for t in entries):
        raise ModelError(f"target_modules must be a list of module names, a regex string or "
                         f"'all-linear', got {target_modules!r}")
    return sorted(set(entries))


def resolve_targets(target_modules, module_names: Mapping[str, str] | Iterable[str]) -> list[str]:
    """The module names ``target_modules`` picks, as peft does, among ``module_names``
    (lm_modules' {name: kind}; a plain list of names is taken as all Linear), in the
    model's order; ModelError where it picks no module (naming what was given and the
    Linear layers there are) or one that is not a Linear."""
    modules = dict(module_names) if isinstance(module_names, Mapping) else \
        {name: LINEAR for name in module_names}
    targets = _checked(target_modules)
    picked = _matches(targets, modules)
    if not picked:
        how = " (a regex, matched against whole names)" if isinstance(targets, str) else ""
        raise ModelError(f"target_modules {target_modules!r}{how} matches no module of the "
                         f"model; its Linear layers: {_short_names(modules)}, or 'all-linear'")
    others = [n for n in picked if modules[n] != LINEAR]
    if others:
        kind = modules[others[0]]
        peft = " (peft would put LoRA on the embedding)" if kind == "Embedding" else ""
        article = "an" if kind[0] in "AEIOU" else "a"
        raise ModelError(f"target_modules {target_modules!r} picks {others[0]}, {article} "
                         f"{kind}{peft}; lora puts adapters on Linear layers: "
                         f"{_short_names(modules)}")
    return picked
