"""lora.CausalLM against transformers + peft in float64 on the CPU (tests/lm_cases.py):
logits, AdamW steps, adapter files, generation, on tiny random Llama and Qwen2 models."""
import copy
from importlib.util import find_spec

import numpy as np
import pytest
from lm_cases import LIBRARIES, float64_logits, float64_steps, tiny_model, token_batch, with_lora

import lora

pytestmark = pytest.mark.skipif(
    not all(map(find_spec, LIBRARIES)),
    reason="the causal-LM tests compare with torch, transformers and peft (the torch extra)")

# f32 on lavapipe: logits within 4e-7 of the largest logit (measured), the bound 1e-5;
# losses and adapters after 5 AdamW steps within 5e-7 at rank 4 and 1.6e-5 at rank 32
# (measured: AdamW divides each element's step by its own gradient's size, so a
# gradient near 0 amplifies f32's rounding), the bound 1e-4, the issue's.
F32_TOL = 1e-5
STEP_TOL = 1e-4


def _rel(got, want, where=None) -> float:
    diff = np.abs(got - want) if where is None else np.abs(got - want)[where]
    return float(diff.max() / np.abs(want).max())


def _padded(rng, batch: int, seq: int):
    """Ids and a mask with a left-padded row (the first) and a right-padded one (the last)."""
    ids = token_batch(rng, batch, seq)
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    mask[-1, -4:] = 0
    return ids, mask


@pytest.mark.parametrize("arch, tied", [   # the default tier: both architectures, both heads
    ("llama", True), pytest.param("llama", False, marks=pytest.mark.slow),
    pytest.param("qwen2", True, marks=pytest.mark.slow), ("qwen2", False)])
def test_logits_equal_transformers_and_peft(device, arch, tied):
    """f32 logits of a peft model (adapters with B drawn, so they count) equal
    transformers + peft in float64 at every real token, with left and right
    padding; Qwen2's q/k/v biases and an untied head included."""
    rng = np.random.default_rng(1)
    pm = with_lora(tiny_model(arch, tied=tied), ["q_proj", "v_proj", "down_proj"])
    ids, mask = _padded(rng, 2, 12)
    lm = lora.CausalLM.from_transformers(pm, device=device)
    assert _rel(lm.logits(ids, mask), float64_logits(pm, ids, mask), mask == 1) < F32_TOL
    assert _rel(lm.logits(ids), float64_logits(pm, ids)) < F32_TOL


@pytest.mark.parametrize("arch, targets, rank, seq", [("llama", ["q_proj", "v_proj"], 4, 12),
                                                     ("qwen2", "all-linear", 32, 12)])
def test_five_adamw_steps_equal_peft(device, arch, targets, rank, seq):
    """Five AdamW steps from the same adapter equal transformers + peft with
    torch's AdamW in float64: every step's loss and the final A and B, with
    -100 labels and padding (rank 32: the gemm backward)."""
    rng = np.random.default_rng(2)
    pm = with_lora(tiny_model(arch, tied=arch == "llama"), targets, r=rank)
    ids, mask = _padded(rng, 2, seq)
    labels = ids.copy()
    labels[0, :4] = -100
    batches = [(ids, labels, mask)] * 5
    want_losses, want = float64_steps(pm, batches, lr=1e-3)
    lm = lora.CausalLM.from_transformers(pm, optimizer=lora.AdamW(lr=1e-3), device=device)
    _train_as(lm, batches, want_losses, want, STEP_TOL)


def _train_as(lm, batches, want_losses, want, tol) -> None:
    """A step per batch: each loss, and then every adapter, within ``tol`` of
    float64's (relative; an adapter's to its largest value)."""
    losses = []
    for batch in batches:
        lm.step(*batch)
        losses.append(lm.loss())
    np.testing.assert_allclose(losses, want_losses, rtol=tol)
    got = lm.adapters()
    assert set(got) == set(want)
    for name, (a, b) in want.items():
        assert _rel(got[name][0], a) < tol and _rel(got[name][1], b) < tol, name


def test_a_saved_adapter_loads_in_peft_and_back(device, tmp_path):
    """A trained adapter saved by save_adapter loads in PeftModel.from_pretrained
    to the same logits, and load_adapter reads it into a fresh model."""
    rng = np.random.default_rng(3)
    model = tiny_model("qwen2")
    lm = lora.CausalLM.from_transformers(model, target_modules="all-linear",
                                         optimizer=lora.AdamW(lr=1e-2), device=device)
    ids = token_batch(rng, 2, 12)
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


def test_generate_again_in_a_kept_shape_builds_and_records_nothing(device, monkeypatch):
    """A generate of a shape made before (same batch, prompt and cache length)
    reuses its cache, graphs and captures: no graph or buffer is made, nothing
    compiled, no bind group created, no plan recorded (both graphs replayed);
    its tokens are a fresh model's (the last call's values do not leak: other
    ids, other padding, fewer new tokens). Building and recording the graphs
    again took 200 ms of host time a call at SmolLM2-135M's 30 layers
    (docs/optimisation-notes.md, "Prefill: ...")."""
    import shaderdsl.compiler
    from lora.models import generate as G
    from lora.models.graph import Graph
    rng = np.random.default_rng(12)
    pm = with_lora(tiny_model("llama"), "all-linear")
    lm = lora.CausalLM.from_transformers(pm, device=device)
    first, ids = token_batch(rng, 2, 7), token_batch(rng, 2, 7)
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    ids[mask == 0] = 0
    lm.generate(first, 9)
    want = lora.CausalLM.from_transformers(pm, device=device).generate(ids, 5,
                                                                       attention_mask=mask)
    before = dict(device.stats)

    def boom(*args, **kwargs):
        raise AssertionError("made or recorded again for a kept shape")
    monkeypatch.setattr(G, "Graph", boom)
    monkeypatch.setattr(Graph, "record_forward", boom)
    monkeypatch.setattr(device, "_new", boom)
    monkeypatch.setattr(shaderdsl.compiler, "_build", boom)
    np.testing.assert_array_equal(lm.generate(ids, 5, attention_mask=mask), want)
    assert lm.generate(first, 1).shape == (2, 8)   # the prefill alone
    for stat in ("modules", "pipelines", "bind_groups"):
        assert device.stats.get(stat) == before.get(stat), stat
    assert len(lm._generations) == 1


def test_f16_mixed_precision_follows_float64(device):
    """dtype=np.float16 (f16 weights and activations, f32 sums, softmax, norms,
    residual stream and loss, f32 masters of A and B) against float64:
    - logits within 5e-3 of the largest logit: each stored f16 activation is
      rounded by up to 2^-11 (4.9e-4) of itself, a dozen roundings in a row
      through two layers (measured 1.9e-3);
    - the loss of 3 AdamW steps within 2e-4 of itself (measured 1e-4 over 5);
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
    batches = [(ids, None, None)] * 3
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
    """With lora_dropout, 3 SGD steps equal transformers + peft in float64
    whose dropouts multiply each adapter's input by this model's masks
    (lora.kernels.dropout.keep_mask of dropout_seed + the module's index and
    the step, over 1 - p); logits() drops nothing."""
    from lm_cases import drop_as

    from lora.kernels.dropout import keep_mask
    p, seed = 0.25, 11
    rng = np.random.default_rng(6)
    pm = with_lora(tiny_model("llama"), ["q_proj", "v_proj", "down_proj"], lora_dropout=p)
    ids = token_batch(rng, 2, 12)

    def mask_of(k, step, shape):
        flat = (int(np.prod(shape[:-1])), shape[-1])
        return (keep_mask(seed + k, step, flat, p) / (1 - p)).reshape(shape)

    batches = [(ids, None, None)] * 3   # SGD: AdamW would amplify a gradient near 0
    want_losses, want = float64_steps(drop_as(pm, mask_of), batches, lr=0.1, sgd=True)
    lm = lora.CausalLM.from_transformers(pm, dropout_seed=seed, device=device,
                                         optimizer=lora.SGD(lr=0.1))
    assert lm.lora_dropout == p   # taken from the peft config
    _train_as(lm, batches, want_losses, want, F32_TOL)
    lm.save_adapter(tmp_path)
    import peft
    trained = peft.PeftModel.from_pretrained(tiny_model("llama"), tmp_path)   # eval: no dropout
    assert _rel(lm.logits(ids), float64_logits(trained, ids)) < F32_TOL


def test_memory_counts_weights_adapters_and_a_step(device):
    """memory(): the frozen weights' bytes are the model's parameters (f32) and
    RoPE's tables; the adapters' include A and B, gradients and AdamW's two
    moments; a step's activations appear once a step has run."""
    model = tiny_model("llama")
    lm = lora.CausalLM.from_transformers(model, target_modules=["q_proj"], rank=4,
                                         device=device)
    c = lm.config
    params = sum(p.numel() for p in model.parameters()) * 4
    tables = 2 * c.max_position_embeddings * (c.head_dim // 2) * 4
    before = lm.memory()
    assert before["weights"] == params + tables
    pairs = c.num_hidden_layers * 4 * (c.hidden_size + c.num_attention_heads * c.head_dim)
    assert before["adapters"] >= 4 * pairs * 4   # A and B, dA and dB, two moments
    assert before["training step"] == 0
    lm.step(token_batch(np.random.default_rng(7), 2, 12))
    assert lm.memory()["training step"] > 2 * 8 * c.vocab_size * 4   # the logits at least


def test_weights_past_the_binding_limit_go_in_chunks(device, monkeypatch):
    """A device that binds less than the embedding (a browser binds 128 MiB;
    Qwen2.5-0.5B's embedding is 272 MB in f16): the embedding and the tied
    head are split into row chunks, one binding each, and logits and a
    training step are unchanged (against float64 transformers + peft)."""
    from lora.models import causal_lm
    real = causal_lm.memory_check

    def small(config, limits, dtype):   # 40 rows of 64 f32 per binding
        return real(config, {**dict(limits), "max-storage-buffer-binding-size": 40 * 64 * 4},
                    dtype)
    monkeypatch.setattr(causal_lm, "memory_check", small)
    rng = np.random.default_rng(8)
    pm = with_lora(tiny_model("llama"), ["q_proj", "v_proj"])
    ids = token_batch(rng, 2, 12)
    lm = lora.CausalLM.from_transformers(pm, device=device, optimizer=lora.AdamW(lr=1e-3))
    assert len(lm.frozen.embed) == 4 and lm.frozen.head is lm.frozen.embed   # 128 rows
    assert _rel(lm.logits(ids), float64_logits(pm, ids)) < F32_TOL
    batches = [(ids, None, None)] * 2
    _train_as(lm, batches, *float64_steps(pm, batches, lr=1e-3), STEP_TOL)


BAD_CALLS = [
    ("step", dict(input_ids=[[3, 4, 200]]), r"input_ids\[0, 2\] = 200 is outside the "
     r"vocabulary \(ids 0..127\)"),
    ("step", dict(input_ids=np.full((1, 300), 5)), r"sequences of 300 tokens are longer than "
     r"the model's max_position_embeddings \(256\)"),
    ("step", dict(input_ids=[[3, 4, 5]], labels=[[3, 4]]), r"labels must have input_ids' "
     r"shape \[1, 3\], got \[1, 2\]"),
    ("step", dict(input_ids=[[3, 4, 5]], labels=[[3, -1, 5]]), r"labels\[0, 1\] = -1 is "
     r"neither a token id \(0..127\) nor -100 \(ignored\)"),
    ("step", dict(input_ids=[[3, 4, 5]], attention_mask=[[1, 2, 1]]), r"attention_mask must "
     r"hold 0 \(padding\) and 1 \(a token\), got the values \[2\]"),
    ("step", dict(input_ids=[[3.0, 4.0]]), r"input_ids must be integers \[batch, seq\]"),
    ("logits", dict(input_ids=[[3, 4]], attention_mask=[[1, 1, 1]]), r"attention_mask must "
     r"have input_ids' shape \[1, 2\], got \[1, 3\]"),
    ("generate", dict(input_ids=[[3, 4]], max_new_tokens=0), r"max_new_tokens must be a "
     r"positive int, got 0"),
    ("generate", dict(input_ids=[[3, 4]], max_new_tokens=256), r"the prompt's last position 1 "
     r"plus 256 new tokens passes the model's max_position_embeddings \(256\)"),
    ("generate", dict(input_ids=[[3, 4]], max_new_tokens=4, eos_token_id=128),
     r"eos_token_id must be token ids \(0..127\), got 128"),
]


@pytest.mark.parametrize("call, kwargs, match", BAD_CALLS,
                         ids=[f"{c}-{m[:30]}" for c, _, m in BAD_CALLS])
def test_bad_input_is_refused_before_any_gpu_work(device, call, kwargs, match):
    """Each mistake raises a ValueError naming what was wrong and what is
    expected, before any dispatch or copy (the device's counters unchanged)."""
    lm = lora.CausalLM.from_transformers(tiny_model("llama"), device=device)
    device.sync()
    before = {k: device.stats[k] for k in ("dispatches", "copies")}
    with pytest.raises(ValueError, match=match):
        getattr(lm, call)(**kwargs)
    assert {k: device.stats[k] for k in ("dispatches", "copies")} == before


def test_model_options_are_refused_by_name(device, tmp_path):
    """LoRA on lm_head, a PeftModel given target_modules again, loss() before a
    step, and an adapter of other modules or ranks given to load_adapter."""
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"LoRA on lm_head is not supported"):
        lora.CausalLM.from_transformers(model, target_modules=["lm_head"], device=device)
    pm = with_lora(tiny_model("llama"), ["q_proj"])
    with pytest.raises(ValueError, match=r"\['target_modules'\] come from the PeftModel's "
                                         r"LoraConfig"):
        lora.CausalLM.from_transformers(pm, target_modules="all-linear", device=device)
    lm = lora.CausalLM.from_transformers(model, target_modules=["v_proj"], device=device)
    with pytest.raises(RuntimeError, match=r"no step recorded yet"):
        lm.loss()
    lora.CausalLM.from_transformers(pm, device=device).save_adapter(tmp_path / "q")
    with pytest.raises(ValueError, match=r"adapts \['model.layers.0.self_attn.q_proj', "
                                         r"'model.layers.1.self_attn.q_proj'\]; this model "
                                         r"adapts \['model.layers.0.self_attn.v_proj'"):
        lm.load_adapter(tmp_path / "q")
    other = lora.CausalLM.from_transformers(model, target_modules=["q_proj"], rank=2,
                                            device=device)
    with pytest.raises(ValueError, match=r"has rank 4 and scale 2; this model's has rank 2 "
                                         r"and scale 4"):
        other.load_adapter(tmp_path / "q")


def test_several_adapters_in_one_batch_as_peft_mixes_them(device, tmp_path):
    """adapter_names (one per sequence: two loaded adapters of other modules and
    ranks, "__base__") give peft's mixed-batch logits and greedy tokens, the
    rows routed through the adapter pools of forward_many."""
    import peft
    import torch
    rng = np.random.default_rng(9)
    base = tiny_model("llama", num_hidden_layers=1)
    for name, targets, r, seed in (("a", ["q_proj", "v_proj"], 4, 1),
                                   ("b", ["o_proj", "down_proj"], 8, 2)):
        with_lora(copy.deepcopy(base), targets, r=r, seed=seed).save_pretrained(tmp_path / name)
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "a", adapter_name="a")
    pm.load_adapter(tmp_path / "b", adapter_name="b")
    lm = lora.CausalLM.from_transformers(base, target_modules=["q_proj"], device=device)
    lm.add_adapter("a", tmp_path / "a")
    lm.add_adapter("b", tmp_path / "b")
    ids, names = token_batch(rng, 4, 9), ["a", "b", "__base__", "a"]
    with torch.no_grad():
        want = copy.deepcopy(pm).double()(input_ids=torch.tensor(ids),
                                          adapter_names=names).logits.numpy()
        tokens = pm.generate(input_ids=torch.tensor(ids), adapter_names=names,
                             max_new_tokens=6, do_sample=False).numpy()
    assert _rel(lm.logits(ids, adapter_names=names), want) < F32_TOL
    np.testing.assert_array_equal(lm.generate(ids, 6, adapter_names=names), tokens)
    with pytest.raises(ValueError, match=r"adapter_names: 'c' is not loaded; expected one of "
                                         r"\['a', 'b', 'default'\] or '__base__'"):
        lm.logits(ids, adapter_names=["a", "b", "c", "a"])


def test_f16_forward_where_the_device_has_matrix_units_in_the_interpreter():
    """Where the device has f16 16x16x16 subgroup matrices (the H200's; here the
    interpreter's), an f16 model's attention forward is still the SIMT kernel
    (faster there: docs/benchmarks.md, round 5), and the logits stay within
    f16's tolerance of float64 (5e-3, as the f16 test)."""
    from shaderdsl import interp
    dev = interp.Device(subgroup_size=32, limits={"max-compute-workgroup-storage-size": 32768})
    pm = with_lora(tiny_model("llama", num_hidden_layers=1, vocab_size=64,
                              intermediate_size=32), ["q_proj"])
    ids = token_batch(np.random.default_rng(10), 1, 5, vocab=64)
    lm = lora.CausalLM.from_transformers(pm, dtype=np.float16, device=dev)
    got = lm.logits(ids)
    kernels = [plan.steps[0].kernel.name for plan, _ in lm._infer[0].forwards
               if hasattr(plan, "steps")]
    assert "attention_f16" in kernels and "attention_matrix" not in kernels
    assert _rel(got, float64_logits(pm, ids)) < 5e-3


def _float64_gradients(pm, ids) -> dict:
    """{module name: (dA, dB)} of transformers + peft's loss in float64."""
    import torch
    m = copy.deepcopy(pm).double()
    m.train()
    m(input_ids=torch.tensor(ids), labels=torch.tensor(ids)).loss.backward()
    grads: dict = {}
    for name, p in m.named_parameters():
        if p.requires_grad:
            module = name.removeprefix("base_model.model.").split(".lora_")[0]
            grads.setdefault(module, {})[name.split(".lora_")[1][0]] = p.grad.numpy()
    return {k: (g["A"], g["B"]) for k, g in grads.items()}


def test_f16_attention_backward_on_matrix_units_in_the_interpreter():
    """A training step of an f16 model on the interpreter's fragments runs the
    matrix backward (attention_matrix_grad_kv and _q), and one SGD step (lr 1:
    the update is minus the gradient) moves every A and B of q, k and v, whose
    gradients pass through attention's, within 1e-2 of float64's largest
    gradient element (f16 activations and P
    and dS rounded to f16 before their products; measured 2.5e-3). Head_dim
    16 (hidden 32, 2 heads sharing a kv head): the fragments' size."""
    from shaderdsl import interp
    dev = interp.Device(subgroup_size=32, limits={"max-compute-workgroup-storage-size": 16384})
    pm = with_lora(tiny_model("llama", num_hidden_layers=1, vocab_size=32, hidden_size=32,
                              intermediate_size=16, num_attention_heads=2,
                              num_key_value_heads=1), ["q_proj", "k_proj", "v_proj"])
    ids = token_batch(np.random.default_rng(13), 1, 6, vocab=32)
    lm = lora.CausalLM.from_transformers(pm, dtype=np.float16, device=dev,
                                         optimizer=lora.SGD(lr=1.0))
    before = lm.adapters()
    lm.step(ids)
    assert lm._train is not None
    kernels = [plan.steps[0].kernel.name for plan, _ in lm._train.backwards
               if hasattr(plan, "steps")]
    assert {"attention_matrix_grad_kv", "attention_matrix_grad_q"} <= set(kernels)
    assert "attention_grad_kv_f16" not in kernels
    after = lm.adapters()
    for name, grads in _float64_gradients(pm, ids).items():
        for got_after, got_before, grad in zip(after[name], before[name], grads):
            assert _rel(got_before - got_after, grad) < 1e-2, name


def test_a_bf16_folder_loads_without_torch_and_runs(device, tmp_path):
    """from_pretrained on a folder save_pretrained wrote in bfloat16 (sharded):
    the weights widened exactly, logits equal transformers' of the same folder
    read as float32, in float64."""
    import torch
    import transformers
    model = tiny_model("qwen2", tied=False).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ids = token_batch(np.random.default_rng(11), 2, 12)
    lm = lora.CausalLM.from_pretrained(tmp_path, target_modules=["k_proj"], device=device)
    same = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert _rel(lm.logits(ids), float64_logits(same, ids)) < F32_TOL


# slow: 14.5 s on lavapipe cold (a vocabulary of 32000); the loss scale's parts are in the
# default tier (test_lm_kernels' grad_scale, test_training's scale_gradients)
@pytest.mark.slow
def test_f16_gradients_of_a_real_vocabulary_do_not_underflow(device):
    """At a vocabulary of 32000 and 128 tokens, the loss gradient of a logit is
    about 1 / (vocab tokens) = 2.4e-7, below most of f16's range: f16 keeps it
    by a loss scale (the token count, undone by the optimizer's grad_scale),
    so one SGD step's update of every A is within 3e-3 of f32's (measured
    1.5e-3; unscaled it was 1.2e-2, and 0 at SmolLM2's sizes)."""
    if not device.has_feature("shader-f16"):
        pytest.skip(f"{device.name} lacks shader-f16")
    pm = with_lora(tiny_model("llama", vocab_size=32000), ["q_proj", "v_proj"])
    ids = token_batch(np.random.default_rng(12), 2, 64, vocab=32000)

    def update(dtype):
        lm = lora.CausalLM.from_transformers(pm, dtype=dtype, optimizer=lora.SGD(lr=1.0),
                                             device=device)
        before = lm.adapters()
        lm.step(ids)
        return {k: a - before[k][0] for k, (a, _) in lm.adapters().items()}

    want, got = update(np.float32), update(np.float16)
    for name, step in want.items():
        assert _rel(got[name], step) < 3e-3, name
