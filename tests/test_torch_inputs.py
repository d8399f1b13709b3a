"""What a torch user passes: parameters that require grad, bfloat16 tensors and
torch modules where this library wants arrays and names. Tensors are read as
their values (the same results as their numpy copies); modules get a hint."""
import copy
import json

import numpy as np
import pytest

import lora
from lora.core.checks import host_values

NO_TORCH = "torch is not installed (the torch extra: pip install -e '.[torch]')"


class _Tensor:
    """What host_values reads of a torch tensor (detach, cpu, numpy, dtype),
    so that the rule is checked where torch is not installed."""

    def __init__(self, values, dtype="torch.float32"):
        self.values, self.dtype = values, dtype

    def detach(self):
        return self

    def cpu(self):
        return self

    def float(self):
        return _Tensor(self.values.astype(np.float32))

    def numpy(self):
        if self.dtype == "torch.bfloat16":
            raise TypeError("Got unsupported ScalarType BFloat16")
        return self.values


def test_tensors_are_read_as_their_values():
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert np.array_equal(host_values(_Tensor(values)), values)
    widened = host_values(_Tensor(values.astype(np.float16), "torch.bfloat16"))
    assert widened.dtype == np.float32 and np.array_equal(widened, values)
    assert host_values([1, 2]).tolist() == [1, 2]


class GELU:  # named as torch.nn's modules are
    pass


class Linear:
    weight, bias, in_features = np.eye(3), None, 3


@pytest.mark.parametrize("module, match", [
    (GELU(), r"got GELU \(torch.nn.GELU\? give its name, 'gelu'\)"),
    (Linear(), r"got Linear \(torch.nn.Linear\? wrap it: lora.Linear\(m.weight, m.bias, "),
])
def test_torch_modules_in_a_network_get_a_hint(module, match):
    rng = np.random.default_rng(0)
    adapted = lora.Linear(rng.normal(size=(3, 3)), rank=2, alpha=4)
    with pytest.raises(ValueError, match=match):
        lora.Network([adapted, module])


def test_torch_tensors_give_what_their_numpy_copies_give(device):
    """A network made from an nn.Sequential's parameters (they require grad),
    stepped on torch tensors, gives the bits of one made from numpy copies;
    lora.forward and forward_many take grad-requiring and bfloat16 tensors."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    x, y = torch.randn(8, 12), torch.randint(0, 3, (8,))
    nets = []
    for read in (lambda t: t, lambda t: t.detach().numpy()):
        net = lora.Network([lora.Linear(read(model[0].weight), read(model[0].bias), rank=4,
                                        alpha=8, seed=1), "gelu",
                            lora.Linear(read(model[2].weight), read(model[2].bias))],
                           loss="xent", optimizer=lora.AdamW(lr=1e-2), device=device)
        net.step(read(x), read(y))
        nets.append(net)
    for got, want in zip(nets[0].adapters()["0"], nets[1].adapters()["0"]):
        assert np.array_equal(got, want)
    a = torch.randn(4, 12, requires_grad=True)
    b = torch.randn(5, 4, requires_grad=True)
    xb = x.to(torch.bfloat16)
    got = lora.forward(xb, a, b, scale=0.5, device=device)
    want = lora.forward(xb.float().numpy(), a.detach().numpy(), b.detach().numpy(), scale=0.5,
                        device=device)
    assert np.array_equal(got, want)
    layers = {"p": lora.LoraLayer(a, b, alpha=8.0)}
    assert isinstance(layers["p"].a, np.ndarray)
    many = lora.forward_many(xb, layers, torch.zeros(8, dtype=torch.int64), device=device)
    assert np.array_equal(many, lora.forward_many(xb.float().numpy(), layers, [0] * 8,
                                                  device=device))


def test_tensors_save_as_their_values(tmp_path):
    """save_adapter of (A, B) tensors that require grad (a peft module's
    lora_A/lora_B weights, as a user would pass them) writes their values;
    bfloat16 ones are widened to float32."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    a = torch.randn(4, 12, requires_grad=True)
    b = torch.randn(5, 4).to(torch.bfloat16).requires_grad_()
    path = lora.save_adapter(tmp_path / "ad", {"q_proj": (a, b)}, alpha=8)
    got = lora.load_adapter(path)["q_proj"]
    assert np.array_equal(got.a, a.detach().numpy())
    assert got.b.dtype == np.float32 and np.array_equal(got.b, b.detach().float().numpy())


def test_a_torch_sequential_trains_as_peft_trains_it(device, tmp_path):
    """Network.from_torch on an nn.Sequential with peft's target_modules: 5 AdamW
    steps from the same initial adapters as peft's model give the same adapters
    (1e-5 relative), and the saved adapter loads into the torch model by name."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    peft = pytest.importorskip("peft", reason="peft is not installed")
    nn = torch.nn

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(10, 16), nn.GELU(), nn.Linear(16, 12), nn.Tanh(),
                             nn.Linear(12, 4))

    model = make()
    net = lora.Network.from_torch(model, target_modules=["0", "4"], rank=4, alpha=8,
                                  loss="mse", optimizer=lora.AdamW(lr=1e-2), device=device)
    assert [str(x) for x in net.layers] == ["<Linear '0' 10 -> 16 rank=4>", "gelu",
                                           "<Linear '2' 16 -> 12 frozen>", "tanh",
                                           "<Linear '4' 12 -> 4 rank=4>"]
    theirs = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8,
                                                        target_modules=["0", "4"]))
    with torch.no_grad():
        for name, (a, b) in net.adapters().items():
            layer = theirs.base_model.model[int(name)]
            layer.lora_A["default"].weight.copy_(torch.tensor(a))
            layer.lora_B["default"].weight.copy_(torch.tensor(b))
    opt = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(5):
        x, y = torch.randn(8, 10), torch.randn(8, 4)
        net.step(x, y)
        opt.zero_grad()
        torch.nn.functional.mse_loss(theirs(x), y).backward()
        opt.step()
    for name, pair in net.adapters().items():
        layer = theirs.base_model.model[int(name)]
        for got, part in zip(pair, (layer.lora_A, layer.lora_B)):
            want = part["default"].weight.detach().numpy()
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    loaded = peft.PeftModel.from_pretrained(make(), net.save_adapter(tmp_path / "adapter"))
    x = torch.randn(5, 10)
    with torch.no_grad():
        want = loaded(x).numpy()
    assert np.abs(net.forward(x) - want).max() <= 1e-5 * np.abs(want).max()


def test_torch_layers_it_cannot_run_are_refused_by_name():
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    nn = torch.nn
    for model, kw, match in (
            (nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)), {}, r"layer '1' is Dropout; "),
            (nn.Sequential(nn.Linear(4, 4), nn.GELU("tanh")), {},
             r"layer '1' is GELU\(approximate='tanh'\)"),
            (nn.Sequential(nn.Linear(4, 4)), {"target_modules": ["q_proj"]},
             r"target_modules \['q_proj'\] name no Linear of the model \(its Linear layers: "
             r"\['0'\]\)"),
            (nn.Linear(4, 4), {}, "expected a torch.nn.Sequential")):
        with pytest.raises(ValueError, match=match):
            lora.Network.from_torch(model, target_modules=kw.get("target_modules", "all-linear"))


class _TorchDtype:
    """What storage_dtype reads of torch.float16: its module and its str."""

    __module__ = "torch"

    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


def test_torch_dtypes_name_the_storage_dtype():
    from lora.core.weight import storage_dtype
    assert storage_dtype(_TorchDtype("float16")) == np.float16
    assert storage_dtype(_TorchDtype("float32")) == np.float32
    with pytest.raises(ValueError, match="dtype: expected float32 or float16, got "):
        storage_dtype(_TorchDtype("bfloat16"))


def test_a_torch_linear_given_as_the_weight_gets_a_hint():
    with pytest.raises(ValueError, match=r"Linear: weight is a torch.nn.Linear, expected its "
                                         r"weight \[out, in\]: lora.Linear\(m.weight, m.bias"):
        lora.Linear(Linear(), rank=2)


def test_from_torch_reads_target_modules_as_peft_does():
    """A string is a regex matched against whole child names (peft's
    re.fullmatch); alpha defaults to peft's 8 (the scale was 1 without one);
    torch.float16 is a dtype; a peft model is refused with the way back to
    its base."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    peft = pytest.importorskip("peft", reason="peft is not installed")
    nn = torch.nn
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    net = lora.Network.from_torch(model, target_modules=r"[02]", rank=2)
    assert [x.name for x in net.linears if x.adapter is not None] == ["0", "2"]
    theirs = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, target_modules=["0"]))
    assert net.linears[0].scale == theirs.base_model.model[0].scaling["default"] == 4.0
    with pytest.raises(ValueError, match=r"target_modules '\[13\]' \(a regex, as peft reads a "
                                         r"string\) matches no Linear of the model"):
        lora.Network.from_torch(model, target_modules=r"[13]")
    assert lora.Network.from_torch(model, target_modules="0", dtype=torch.float16).dtype == \
        np.float16
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["0"]))
    with pytest.raises(ValueError, match=r"got a peft model; give the torch model as it was "
                                         r"before get_peft_model"):
        lora.Network.from_torch(adapted, target_modules=["0"])


def test_from_torch_refuses_a_module_whose_forward_it_cannot_read():
    """A custom Module's children chained in order gave another function (its
    forward adds x back): 1.16 from torch's output, silently. Refused now; a
    Sequential, or a subclass keeping Sequential's forward, is taken."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    nn = torch.nn

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(6, 6), nn.Linear(6, 3)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)) + x)

    with pytest.raises(ValueError, match=r"expected a torch.nn.Sequential, got Residual, whose "
                                         r"forward is not read here .*lora.Linear\(m.fc1.weight, "
                                         r"m.fc1.bias, rank=8, name='fc1'\)"):
        lora.Network.from_torch(Residual(), target_modules=["fc1"])

    class Plain(nn.Sequential):
        pass

    net = lora.Network.from_torch(Plain(nn.Linear(3, 3)), target_modules="all-linear", rank=2)
    assert [x.name for x in net.linears] == ["0"]


def test_rslora_trains_saves_and_loads_as_peft_does(tmp_path):
    """from_torch(use_rslora=True) is LoraConfig(use_rslora=True): the scale
    alpha / sqrt(rank), 5 AdamW steps beside peft's, and the saved adapter
    says use_rslora with the same alpha, so peft loads it to our outputs and
    net.load_adapter reads it back. A layer without it among them saves each
    alpha as scale * rank (peft's flag is one for the whole adapter)."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    peft = pytest.importorskip("peft", reason="peft is not installed")
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(12, 6), torch.randn(12, 3)
    net = lora.Network.from_torch(model, target_modules="all-linear", rank=4, alpha=8,
                                  use_rslora=True, optimizer=lora.AdamW(lr=1e-2))
    theirs = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(
        r=4, lora_alpha=8, use_rslora=True, target_modules="all-linear"))
    for name, (a, b) in net.adapters().items():
        layer = theirs.base_model.model[int(name)]
        assert net.linears[int(name) // 2].scale == layer.scaling["default"] == 4.0
        with torch.no_grad():
            layer.lora_A["default"].weight.copy_(torch.from_numpy(a))
            layer.lora_B["default"].weight.copy_(torch.from_numpy(b))
    trained = [p for p in theirs.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-2)
    for _ in range(5):
        net.step(x, y)
        opt.zero_grad()
        torch.nn.functional.mse_loss(theirs(x), y).backward()
        opt.step()
    for name, (a, b) in net.adapters().items():
        layer = theirs.base_model.model[int(name)]
        for part, mine in (("lora_A", a), ("lora_B", b)):
            got = getattr(layer, part)["default"].weight.detach().numpy()
            assert np.abs(got - mine).max() <= 1e-5 * np.abs(mine).max()
    path = net.save_adapter(tmp_path / "rs")
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["use_rslora"] is True and config["lora_alpha"] == 8
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(model), path)
    with torch.no_grad():
        want = loaded(x).numpy()
    assert np.abs(net.forward(x) - want).max() <= 1e-5 * np.abs(want).max()
    again = lora.Network.from_torch(model, target_modules="all-linear", rank=4, alpha=8,
                                    use_rslora=True)
    again.load_adapter(path)
    mixed = lora.Network([lora.Linear(np.eye(3), rank=4, alpha=8, use_rslora=True, name="a"),
                          lora.Linear(np.eye(3), rank=4, alpha=8, name="b")])
    config = json.loads((mixed.save_adapter(tmp_path / "mixed") / "adapter_config.json")
                        .read_text())
    assert config["use_rslora"] is False
    assert {n: layer.scale for n, layer in lora.load_adapter(tmp_path / "mixed").items()} == \
        {"a": 4.0, "b": 2.0}
