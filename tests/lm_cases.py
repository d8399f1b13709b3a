"""Tiny transformers language models and their float64 answers, for the tests
of lora.CausalLM: random Llama- and Qwen2-shaped models (hidden 64, 2 layers,
4 heads, 2 kv heads, vocab 128), made and run by transformers + peft on the
CPU in float64, the reference every GPU result is compared with. Its functions
need torch, transformers and peft; they import them when called, since peft alone
takes 6 s to import and every pytest-xdist worker collects every test file."""
from __future__ import annotations

import numpy as np

LIBRARIES = ("torch", "transformers", "peft")

ARCHS = ("llama", "qwen2")
SMALL: dict = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
             rms_norm_eps=1e-6)


def tiny_config(arch: str = "llama", *, tied: bool = True, **sizes):
    """A transformers config of ``arch`` with SMALL's sizes (``sizes`` override them)."""
    import transformers
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    extra = {"attention_bias": True} if arch == "llama" and sizes.pop("bias", False) else {}
    return cls(**{**SMALL, **sizes, **extra}, tie_word_embeddings=tied,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_model(arch: str = "llama", *, seed: int = 0, tied: bool = True, **sizes):
    """A random float32 causal LM of ``arch``, its norm weights and biases drawn
    too (transformers starts them at 1 and 0, which would hide a kernel that
    skipped them), in eval mode, with torch's SDPA attention (on the CPU its
    math kernel; transformers' eager attention turns a left pad's row, which
    sees no key, into NaN, which then reaches every row through V)."""
    import torch
    import transformers
    torch.manual_seed(seed)
    config = tiny_config(arch, tied=tied, **sizes)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def with_lora(model, target_modules, *, r: int = 4, alpha: int = 8, seed: int = 0,
              random_b: bool = True, **config):
    """``model`` wrapped by peft.get_peft_model with a LoraConfig; with
    ``random_b`` every lora_B drawn too (peft starts B at 0, which would make
    the first forward blind to B and its gradient to A)."""
    import peft
    import torch
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules,
                          lora_dropout=config.pop("lora_dropout", 0.0), **config)
    pm = peft.get_peft_model(model, cfg)
    if random_b:
        gen = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return pm


def token_batch(rng, batch: int, seq: int, vocab: int = 128) -> np.ndarray:
    """Random ids [batch, seq], int64, away from the special ids 0-2."""
    return rng.integers(3, vocab, size=(batch, seq)).astype(np.int64)


def float64_logits(model, ids, mask=None) -> np.ndarray:
    """transformers' logits [batch, seq, vocab] in float64 (a copy of ``model``)."""
    import copy

    import torch
    m = copy.deepcopy(model).double()
    with torch.no_grad():
        out = m(input_ids=torch.tensor(ids),
                attention_mask=None if mask is None else torch.tensor(mask))
    return out.logits.numpy()


def float64_steps(pm, batches, *, lr: float = 1e-3, sgd: bool = False,
                  **adamw) -> tuple[list, dict]:
    """transformers + peft trained in float64 with torch's AdamW (``sgd``: plain
    SGD) over every LoRA parameter, one step per (ids, labels or None: the ids,
    mask) of ``batches``: (the loss of each step before its update, {module
    name: (A, B)} after the last)."""
    import copy

    import torch
    m = copy.deepcopy(pm).double()
    m.train()
    params = [p for n, p in m.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr) if sgd else torch.optim.AdamW(params, lr=lr, **adamw)
    losses = []
    for ids, labels, mask in batches:
        out = m(input_ids=torch.tensor(ids),
                labels=torch.tensor(ids if labels is None else labels),
                attention_mask=None if mask is None else torch.tensor(mask))
        losses.append(out.loss.item())
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    return losses, peft_adapters(m)


def drop_as(pm, mask_of):
    """``pm`` (a copy) with every LoRA module's dropout replaced by a fixed
    mask: the input of the k-th adapted module (in the model's order) at
    optimizer step s times ``mask_of(k, s, shape)`` (which counts the steps
    itself: the s-th call for module k)."""
    import copy

    import torch
    m = copy.deepcopy(pm)

    class Fixed(torch.nn.Module):
        def __init__(self, k):
            super().__init__()
            self.k, self.calls = k, 0

        def forward(self, x):
            mask = mask_of(self.k, self.calls, tuple(x.shape))
            self.calls += 1
            return x * torch.tensor(mask, dtype=x.dtype)

    k = 0
    for _, module in m.base_model.model.named_modules():
        if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
            module.lora_dropout["default"] = Fixed(k)
            k += 1
    return m


def peft_adapters(pm) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{module name as peft saves it ("model.layers.0.self_attn.q_proj"): (A, B)}
    of a PeftModel's default adapter, float64."""
    out = {}
    for name, module in pm.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            a = module.lora_A["default"].weight.detach().double().numpy()
            b = module.lora_B["default"].weight.detach().double().numpy()
            out[name] = (a, b)
    return out
