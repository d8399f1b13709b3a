"""lora.CausalLM against transformers + peft in float64 on the CPU (tests/lm_cases.py):
logits, AdamW steps, adapter files, generation, on tiny random Llama and Qwen2 models."""
import copy

import numpy as np
import pytest

pytest.importorskip("torch", reason="the causal-LM tests compare with torch (not installed)")
pytest.importorskip("peft", reason="the causal-LM tests compare with peft (not installed)")

from lm_cases import (  # noqa: E402
    float64_logits,
    float64_steps,
    tiny_model,
    token_batch,
    with_lora,
)

import lora  # noqa: E402

# f32 on lavapipe: logits within 4e-7 of the largest logit, losses and adapters after 5
# AdamW steps within 5e-7 (measured); the bound is 1e-4.
F32_TOL = 1e-5


def _rel(got, want, where=None) -> float:
    diff = np.abs(got - want) if where is None else np.abs(got - want)[where]
    return float(diff.max() / np.abs(want).max())


def _padded(rng, batch: int, seq: int):
    """Ids and a mask with a left-padded row and a right-padded one."""
    ids = token_batch(rng, batch, seq)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    mask[-1, -4:] = 0
    return ids, mask


@pytest.mark.parametrize("arch, tied", [("llama", True), ("llama", False), ("qwen2", True),
                                        ("qwen2", False)])
def test_logits_equal_transformers_and_peft(device, arch, tied):
    """f32 logits of a peft model (adapters with B drawn, so they count) equal
    transformers + peft in float64 at every real token, with left and right
    padding; Qwen2's q/k/v biases and an untied head included."""
    rng = np.random.default_rng(1)
    pm = with_lora(tiny_model(arch, tied=tied), ["q_proj", "v_proj", "down_proj"])
    ids, mask = _padded(rng, 3, 11)
    lm = lora.CausalLM.from_transformers(pm, device=device)
    assert _rel(lm.logits(ids, mask), float64_logits(pm, ids, mask), mask == 1) < F32_TOL
    assert _rel(lm.logits(ids), float64_logits(pm, ids)) < F32_TOL


@pytest.mark.parametrize("arch, targets", [("llama", ["q_proj", "v_proj"]),
                                           ("qwen2", "all-linear")])
def test_five_adamw_steps_equal_peft(device, arch, targets):
    """Five AdamW steps from the same adapter equal transformers + peft with
    torch's AdamW in float64: every step's loss and the final A and B, with
    -100 labels and padding."""
    rng = np.random.default_rng(2)
    pm = with_lora(tiny_model(arch, tied=arch == "llama"), targets)
    ids, mask = _padded(rng, 2, 12)
    labels = ids.copy()
    labels[0, :4] = -100
    batches = [(ids, labels, mask)] * 5
    want_losses, want = float64_steps(pm, batches, lr=1e-3)
    lm = lora.CausalLM.from_transformers(pm, optimizer=lora.AdamW(lr=1e-3), device=device)
    losses = []
    for batch in batches:
        lm.step(*batch)
        losses.append(lm.loss())
    np.testing.assert_allclose(losses, want_losses, rtol=F32_TOL)
    got = lm.adapters()
    assert set(got) == set(want)
    for name, (a, b) in want.items():
        assert _rel(got[name][0], a) < F32_TOL and _rel(got[name][1], b) < F32_TOL, name


def test_a_saved_adapter_loads_in_peft_and_back(device, tmp_path):
    """A trained adapter saved by save_adapter loads in PeftModel.from_pretrained
    to the same logits, and load_adapter reads it into a fresh model."""
    rng = np.random.default_rng(3)
    model = tiny_model("qwen2")
    lm = lora.CausalLM.from_transformers(model, target_modules="all-linear",
                                         optimizer=lora.AdamW(lr=1e-2), device=device)
    ids = token_batch(rng, 2, 10)
    for _ in range(2):
        lm.step(ids)
    lm.save_adapter(tmp_path / "adapter")
    import peft
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "adapter")
    want = float64_logits(pm, ids)
    assert _rel(lm.logits(ids), want) < F32_TOL
    fresh = lora.CausalLM.from_transformers(model, target_modules="all-linear", device=device)
    fresh.load_adapter(tmp_path / "adapter")
    assert _rel(fresh.logits(ids), want) < F32_TOL


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_greedy_generation_is_transformers_token_for_token(device, arch):
    """24 new tokens from left-padded prompts equal transformers + peft's greedy
    generate (do_sample=False), and so does stopping at end-of-sequence ids:
    finished rows padded, the output as long as transformers makes it."""
    import torch
    rng = np.random.default_rng(4)
    pm = with_lora(tiny_model(arch), "all-linear")
    ids = token_batch(rng, 3, 7)
    mask = np.ones_like(ids)
    mask[1, :2] = mask[2, :4] = 0
    ids[mask == 0] = 0
    lm = lora.CausalLM.from_transformers(pm, device=device)
    got = lm.generate(ids, 24, attention_mask=mask)
    for eos in (None, int(got[0, 9]), [int(got[1, 8]), int(got[2, 12])]):
        mine = got if eos is None else lm.generate(ids, 24, attention_mask=mask,
                                                   eos_token_id=eos)
        with torch.no_grad():
            want = pm.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                               max_new_tokens=24, do_sample=False, eos_token_id=eos).numpy()
        np.testing.assert_array_equal(mine, want, err_msg=f"eos_token_id={eos}")


def test_f16_mixed_precision_follows_float64(device):
    """dtype=np.float16 (f16 weights and activations, f32 sums, softmax, norms,
    residual stream and loss, f32 masters of A and B) against float64:
    - logits within 5e-3 of the largest logit: each stored f16 activation is
      rounded by up to 2^-11 (4.9e-4) of itself, a dozen roundings in a row
      through two layers (measured 1.9e-3);
    - the loss of 5 AdamW steps within 2e-4 of itself (measured 1e-4);
    - A and B within 2 lr per step of float64's: AdamW moves every element by
      about lr whatever its gradient's size, so an element whose gradient is
      within f16's noise of 0 may move the other way (measured 1.6e-3 after
      5 steps of lr 1e-3; the bound 1e-2)."""
    if not device.has_feature("shader-f16"):
        pytest.skip(f"{device.name} lacks shader-f16")
    rng = np.random.default_rng(5)
    pm = with_lora(tiny_model("llama"), "all-linear")
    ids = token_batch(rng, 2, 12)
    lm = lora.CausalLM.from_transformers(pm, dtype=np.float16, device=device,
                                         optimizer=lora.AdamW(lr=1e-3))
    assert _rel(lm.logits(ids), float64_logits(pm, ids)) < 5e-3
    batches = [(ids, None, None)] * 5
    want_losses, want = float64_steps(pm, batches, lr=1e-3)
    losses = []
    for batch in batches:
        lm.step(*batch)
        losses.append(lm.loss())
    np.testing.assert_allclose(losses, want_losses, rtol=2e-4)
    got = lm.adapters()
    for name, pair in want.items():
        for mine, theirs in zip(got[name], pair):
            assert np.abs(mine - theirs).max() < 2 * 1e-3 * len(batches), name


def test_lora_dropout_drops_each_adapter_input_with_its_own_mask(device, tmp_path):
    """With lora_dropout, 3 AdamW steps equal transformers + peft in float64
    whose dropouts multiply each adapter's input by this model's masks
    (lora.kernels.dropout.keep_mask of dropout_seed + the module's index and
    the step, over 1 - p); logits() drops nothing."""
    from lm_cases import drop_as

    from lora.kernels.dropout import keep_mask
    p, seed = 0.25, 11
    rng = np.random.default_rng(6)
    pm = with_lora(tiny_model("llama"), ["q_proj", "v_proj", "down_proj"], lora_dropout=p)
    ids = token_batch(rng, 2, 10)

    def mask_of(k, step, shape):
        flat = (int(np.prod(shape[:-1])), shape[-1])
        return (keep_mask(seed + k, step, flat, p) / (1 - p)).reshape(shape)

    batches = [(ids, None, None)] * 3
    want_losses, want = float64_steps(drop_as(pm, mask_of), batches, lr=1e-3)
    lm = lora.CausalLM.from_transformers(pm, dropout_seed=seed, device=device,
                                         optimizer=lora.AdamW(lr=1e-3))
    assert lm.lora_dropout == p   # taken from the peft config
    losses = []
    for batch in batches:
        lm.step(*batch)
        losses.append(lm.loss())
    np.testing.assert_allclose(losses, want_losses, rtol=F32_TOL)
    got = lm.adapters()
    for name, (a, b) in want.items():
        assert _rel(got[name][0], a) < F32_TOL and _rel(got[name][1], b) < F32_TOL, name
    lm.save_adapter(tmp_path)
    import peft
    trained = peft.PeftModel.from_pretrained(tiny_model("llama"), tmp_path)   # eval: no dropout
    assert _rel(lm.logits(ids), float64_logits(trained, ids)) < F32_TOL
