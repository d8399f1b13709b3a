"""Adapter files through real peft, both ways, for every combination of modules of
different ranks (rank_pattern), of different alphas (alpha_pattern), rsLoRA and
bfloat16 weights: what peft saves, load_adapter reads with peft's weights and scales;
what save_adapter writes, peft loads with ours. Skips without torch and peft (the torch
extra, which scripts/setup.sh installs)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from safetensors import safe_open

from lora.training.adapter_io import WEIGHTS_NAME, load_adapter, save_adapter

# The modules of the model below, by their names in it.
MODULES = ("layers.0.q_proj", "layers.0.v_proj", "layers.1.q_proj", "layers.1.v_proj")
COMBINATIONS = list(itertools.product([False, True], repeat=4))


@pytest.fixture(scope="module")
def torch():
    """torch, imported by the tests that run (not at collection: torch and peft
    take 6 s of CPU to import, in every pytest-xdist worker that collects this file)."""
    return pytest.importorskip("torch", reason="needs torch (the torch extra: "
                                               "pip install -e '.[torch]')")


@pytest.fixture(scope="module")
def peft(torch):
    return pytest.importorskip("peft", reason="needs peft (the torch extra: "
                                              "pip install -e '.[torch]')")


def combination_id(combo) -> str:
    names = ("rank_pattern", "alpha_pattern", "rslora", "bf16")
    return "-".join(n for n, on in zip(names, combo) if on) or "plain"


def base_model(torch, bf16: bool):
    """Modules named layers.{0,1}.{q,v}_proj, as in a transformer."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.v_proj = torch.nn.Linear(6, 5), torch.nn.Linear(5, 4)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block(), Block()])

    torch.manual_seed(0)
    return Net().to(torch.bfloat16 if bf16 else torch.float32)


def peft_layers(model) -> dict:
    """{module: (A, B, scale)} of a peft model, A and B its torch weights."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            out[name.removeprefix("base_model.model.")] = (
                module.lora_A["default"].weight.detach(), module.lora_B["default"].weight.detach(),
                module.scaling["default"])
    return out


def config_fields(rank_pattern: bool, alpha_pattern: bool, rslora: bool) -> dict:
    return {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
            "use_rslora": rslora, "init_lora_weights": False,
            "rank_pattern": {r"layers\.1\.q_proj": 2, "v_proj": 3} if rank_pattern else {},
            "alpha_pattern": {r"layers\.0\.v_proj": 5} if alpha_pattern else {}}


@pytest.mark.parametrize("combo", COMBINATIONS, ids=combination_id)
def test_what_peft_saves_loads_here(tmp_path, combo, torch, peft):
    rank_pattern, alpha_pattern, rslora, bf16 = combo
    torch.manual_seed(1)
    model = peft.get_peft_model(base_model(torch, bf16), peft.LoraConfig(
        **config_fields(rank_pattern, alpha_pattern, rslora)))
    model.to(torch.bfloat16 if bf16 else torch.float32)  # peft makes adapters float32
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / WEIGHTS_NAME), framework="np") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16" if bf16 else "F32"}
    want = peft_layers(model)
    got = load_adapter(tmp_path)
    assert sorted(got) == sorted(want) == sorted(MODULES)
    for module, (a, b, scale) in want.items():
        layer = got[module]
        assert layer.a.dtype == np.float32 and np.array_equal(layer.a, a.float().numpy()), module
        assert np.array_equal(layer.b, b.float().numpy()), module
        assert layer.scale == pytest.approx(scale, rel=1e-12), module


@pytest.mark.parametrize("combo", COMBINATIONS, ids=combination_id)
def test_what_is_saved_here_loads_in_peft(tmp_path, combo, torch, peft):
    rank_pattern, alpha_pattern, rslora, bf16 = combo
    rng = np.random.default_rng(2)
    ranks = {m: (2 if m == "layers.1.q_proj" else 3 if "v_proj" in m else 4) if rank_pattern
             else 4 for m in MODULES}
    alphas = {m: 5.0 if alpha_pattern and m == "layers.0.v_proj" else 8.0 for m in MODULES}
    dims = {"q_proj": (6, 5), "v_proj": (5, 4)}
    layers = {m: (rng.standard_normal((ranks[m], dims[m[-6:]][0]), dtype=np.float32),
                  rng.standard_normal((dims[m[-6:]][1], ranks[m]), dtype=np.float32))
              for m in MODULES}
    save_adapter(tmp_path, layers, alpha=alphas, use_rslora=rslora)
    model = peft.PeftModel.from_pretrained(base_model(torch, bf16), tmp_path)
    got = peft_layers(model)
    assert sorted(got) == sorted(MODULES)
    for module, (a, b) in layers.items():
        peft_a, peft_b, peft_scale = got[module]
        # peft keeps the file's float32, or casts it to the model's dtype: either way,
        # its weights are ours rounded to its dtype.
        want_a, want_b = (torch.from_numpy(m).to(peft_a.dtype).float().numpy() for m in (a, b))
        assert np.array_equal(peft_a.float().numpy(), want_a), module
        assert np.array_equal(peft_b.float().numpy(), want_b), module
        scale = alphas[module] / (np.sqrt(ranks[module]) if rslora else ranks[module])
        assert peft_scale == pytest.approx(scale, rel=1e-12), module
