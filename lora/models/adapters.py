"""A peft model's LoRA adapter, taken from memory: its LoraConfig's fields and each
wrapped module's A and B, by peft's module names ("model.layers.0.self_attn.q_proj").

Only plain LoRA on Linear layers is taken (what lora runs: ``B @ (A @ x)`` scaled,
the base frozen); what peft trains beside it or instead of it is refused by name:
``bias`` other than "none", ``modules_to_save``, DoRA and peft's other LoRA variants,
LoRA on embeddings, a bias on lora_B, an adapter merged into the base weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.checks import host_values
from ..training.adapter_io import LoraLayer
from .checks import ModelError

# LoraConfig fields that change what an adapter computes or trains (peft 0.22): each
# must be off (false, None, empty).
VARIANT_FIELDS = ("use_dora", "use_qalora", "lora_bias", "layer_replication",
                  "alora_invocation_tokens", "trainable_token_indices", "target_parameters",
                  "use_bdlora", "arrow_config", "kasa_config", "velora_config",
                  "monteclora_config", "megatron_config")


@dataclass(frozen=True)
class PeftAdapter:
    """A peft model's active LoRA adapter: its LoraConfig's fields (``target_modules`` a
    sorted list, or the regex string) and ``layers``, {module name: LoraLayer} with each
    module's A [r, in] and B [out, r] (copies, float32 or float16 as peft holds them,
    bfloat16 widened), its lora_alpha and use_rslora (so each layer's ``scale`` is peft's
    ``scaling``)."""

    name: str
    r: int
    lora_alpha: float
    target_modules: list[str] | str | None
    use_rslora: bool
    rank_pattern: dict
    alpha_pattern: dict
    lora_dropout: float
    base_model_name_or_path: str | None
    layers: dict[str, LoraLayer]


def _field(config, name: str):
    value = getattr(config, name, None)
    return getattr(value, "value", value)  # peft's enums (PeftType.LORA) as their strings


def check_lora_config(config, name: str) -> None:
    """A LoraConfig lora can run: peft_type LORA, bias "none", no modules_to_save, no
    variant (VARIANT_FIELDS); ModelError naming the field and its value."""
    where = f"peft adapter {name!r}"
    if _field(config, "peft_type") != "LORA":
        raise ModelError(f"{where}: peft_type {_field(config, 'peft_type')!r}; lora runs LoRA")
    if _field(config, "bias") not in (None, "none"):
        raise ModelError(f"{where}: bias={_field(config, 'bias')!r} trains the base model's "
                         f"biases with the adapter; lora trains adapters only (bias='none')")
    if _field(config, "modules_to_save"):
        raise ModelError(f"{where}: modules_to_save={_field(config, 'modules_to_save')!r} "
                         f"trains whole copies of those modules; lora trains LoRA adapters only")
    for field in VARIANT_FIELDS:
        value = _field(config, field)
        if value is not None and value is not False and value != [] and value != {}:
            raise ModelError(f"{where}: {field}={value!r}: lora runs plain LoRA adapters "
                             f"(scale * B @ A on Linear layers)")


def active_config(model) -> tuple[str, Any]:
    """(the name, the LoraConfig) of a peft model's one active adapter, checked."""
    names = getattr(model, "active_adapters", None)
    names = [names] if isinstance(names, str) else list(names or [])
    if len(names) != 1:
        raise ModelError(f"the peft model has {len(names)} active adapters {names}; "
                         f"set_adapter(name) to the one to take")
    config = model.peft_config[names[0]]
    check_lora_config(config, names[0])
    return names[0], config


def _layer(module_name: str, module, adapter: str, use_rslora: bool) -> LoraLayer:
    """One wrapped module's adapter, after checking it is plain, unmerged LoRA."""
    where = f"peft adapter {adapter!r}: {module_name}"
    if getattr(module, "lora_variant", {}).get(adapter) is not None:
        raise ModelError(f"{where} is a {type(module.lora_variant[adapter]).__name__} (a LoRA "
                         f"variant); lora runs plain LoRA")
    if getattr(module, "merged_adapters", None):
        raise ModelError(f"{where} is merged into the base weight (merge_adapter); call "
                         f"model.unmerge_adapter() first")
    if module.lora_B[adapter].bias is not None:
        raise ModelError(f"{where}: lora_B has a bias (lora_bias); lora runs B @ A without one")
    a, b = (np.array(host_values(part[adapter].weight), copy=True)
            for part in (module.lora_A, module.lora_B))
    layer = LoraLayer(a, b, alpha=float(module.lora_alpha[adapter]), use_rslora=use_rslora)
    if not math.isclose(layer.scale, float(module.scaling[adapter]), rel_tol=1e-6):
        raise ModelError(f"{where}: scaling {module.scaling[adapter]} is not lora_alpha / "
                         f"{'sqrt(r)' if use_rslora else 'r'} = {layer.scale} (changed by "
                         f"set_scale or scale_layer?); lora takes the adapter as configured")
    return layer


def peft_adapter(model) -> PeftAdapter:
    """The active adapter of a peft model (``get_peft_model`` / ``PeftModel``) of a
    transformers causal LM: its LoraConfig's fields and every wrapped module's layer."""
    if not (hasattr(model, "peft_config") and hasattr(model, "get_base_model")):
        raise ModelError(f"peft_adapter: expected a peft model (get_peft_model, "
                         f"PeftModel.from_pretrained), got {type(model).__name__}")
    name, config = active_config(model)
    layers = {}
    for module_name, module in model.get_base_model().named_modules():
        if name in (getattr(module, "lora_embedding_A", None) or {}):
            raise ModelError(f"peft adapter {name!r}: {module_name} is an Embedding with LoRA; "
                             f"lora runs LoRA on Linear layers")
        if name in (getattr(module, "lora_A", None) or {}):
            layers[module_name] = _layer(module_name, module, name, bool(config.use_rslora))
    if not layers:
        raise ModelError(f"peft adapter {name!r} wraps no module")
    targets = config.target_modules
    return PeftAdapter(name=name, r=int(config.r), lora_alpha=float(config.lora_alpha),
                       target_modules=sorted(targets) if isinstance(targets, (set, list, tuple))
                       else targets, use_rslora=bool(config.use_rslora),
                       rank_pattern=dict(config.rank_pattern or {}),
                       alpha_pattern=dict(config.alpha_pattern or {}),
                       lora_dropout=float(config.lora_dropout),
                       base_model_name_or_path=config.base_model_name_or_path, layers=layers)
