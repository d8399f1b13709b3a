"""What a torch user passes: parameters that require grad, bfloat16 tensors and
torch modules where this library wants arrays and names. Tensors are read as
their values (the same results as their numpy copies); modules get a hint."""
import numpy as np
import pytest

import lora
from lora.core.checks import host_values


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
    torch = pytest.importorskip("torch", reason="torch is not installed (its wheels bring CUDA)")
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
