"""The engine's tiling rule (lora.core.tilings): a valid tiling for every
shape of issue 43's transformer, within the H200's limits and within
WebGPU's defaults where asked, and base_kernel taking it."""
from __future__ import annotations

import pytest

from lora.core.tilings import base_tiling, fits, product_tiling
from lora.kernels.registry import KERNELS

H200 = {"max-compute-workgroup-storage-size": 49152, "max-compute-invocations-per-workgroup": 1024}
DEFAULTS = {"max-compute-workgroup-storage-size": 16384,
            "max-compute-invocations-per-workgroup": 256}
# tokens x out x in: the issue's transformer products, and its square GEMM
SHAPES = ((4096, 576, 576), (4096, 1536, 576), (4096, 49152, 576), (4096, 896, 4864),
          (4096, 4096, 4096))


def _blocks(t) -> str:
    return f"{t.rows}x{t.cols}{' exact' if t.exact else ''}"


def test_the_issues_shapes_get_the_documented_tilings():
    """The module docstring's table: 16-accumulator blocks where they make 132
    workgroups, 128 x 128 where they would leave SMs idle; exact where whole."""
    got = {shape: _blocks(product_tiling(*shape, "row", "col", H200)) for shape in SHAPES}
    assert got == {(4096, 576, 576): "128x128", (4096, 1536, 576): "256x128 exact",
                   (4096, 49152, 576): "256x128 exact", (4096, 896, 4864): "128x128 exact",
                   (4096, 4096, 4096): "256x128 exact"}


@pytest.mark.parametrize("limits", [H200, DEFAULTS], ids=["h200", "webgpu-defaults"])
@pytest.mark.parametrize("name", ["dense", "dense_grad_input"])
def test_every_shape_gets_a_tiling_its_kernel_builds_within_the_limits(limits, name):
    """For each shape, both base products: the kernel builds with the rule's
    tiling (an exact one only on whole blocks), and its workgroup memory and
    size are within the limits (WebGPU's defaults: 16 KiB, 256 invocations)."""
    for tokens, out_dim, in_dim in SHAPES:
        params = dict(in_dim=in_dim, out_dim=out_dim, tokens=tokens)
        t = base_tiling(name, limits, **params)
        kernel = KERNELS[f"{name}_matrix"].kernel(**params, tiling=t)
        assert kernel.workgroup_bytes <= limits["max-compute-workgroup-storage-size"], str(t)
        assert kernel.threads_per_workgroup <= limits["max-compute-invocations-per-workgroup"]
        assert kernel.workgroup_bytes == t.shared_bytes("row", "col" if name == "dense" else "row")
        assert t.read_width == 8 and "bitcast<vec2<f16>>" in kernel.wgsl


def test_the_defaults_take_the_64_by_64_block_and_odd_widths_read_four():
    t = product_tiling(4096, 576, 576, "row", "col", DEFAULTS)
    assert (t.rows, t.cols, t.exact) == (64, 64, True) and fits(t, DEFAULTS, "row", "col")
    assert base_tiling("dense", H200, in_dim=1156, out_dim=1024, tokens=512).read_width == 4
    assert base_tiling("dense_grad_input", H200, in_dim=1024, out_dim=1024, tokens=512,
                       g_stride=2048, g_column=1028).read_width == 4


def test_small_products_take_the_smallest_block():
    """Where no candidate makes 132 workgroups, the one with the most, of equals
    the smallest; a decode's few tokens (a language model's head: 49152
    columns) in the block that pads them least, not 256 rows for one token."""
    assert _blocks(product_tiling(20, 44, 24)) == "64x64"
    assert _blocks(product_tiling(512, 2560, 2560, limits=H200)) == "128x64 exact"
    assert _blocks(product_tiling(4, 49152, 576, "row", "col", H200)) == "64x64"
    assert _blocks(product_tiling(4096, 576, 576, "row", "col", H200)) == "128x128"


def test_bad_shapes_and_limits_are_refused():
    with pytest.raises(ValueError, match=r"positive int M, N, K, got \(0, 64, 64\)"):
        product_tiling(0, 64, 64)
    with pytest.raises(ValueError, match="no engine tiling fits the limits"):
        product_tiling(64, 64, 64, limits={"max-compute-workgroup-storage-size": 8192})


def test_an_f16_network_runs_its_base_products_on_the_rules_tiling():
    """base_kernel, the one place a base product's kernel is picked: the
    matrix form with the rule's tiling for the device's limits."""
    from lora.training.network import base_kernel
    from shaderdsl import interp
    dev = interp.Device(subgroup_size=32, limits=H200)
    name, params = base_kernel("dense", dev, "f16", in_dim=2560, out_dim=2560, tokens=4096,
                               bias=False)
    assert name == "dense_matrix" and _blocks(params["tiling"]) == "256x128 exact"
    name, params = base_kernel("dense_grad_input", interp.Device(subgroup_size=32), "f16",
                               in_dim=576, out_dim=1536, tokens=4096, accumulate=True)
    assert name == "dense_grad_input_matrix" and params["tiling"].shared_bytes() <= 16384
    assert base_kernel("dense", dev, "f32", in_dim=2560, out_dim=2560, tokens=8)[0] == \
        "dense_tiled"


def test_the_autotuner_times_the_candidates_and_base_kernel_takes_its_choice():
    """autotune_product times the tilings it is given on the device (scratch
    buffers of the product's shape), caches the fastest, and product_tiling
    (base_kernel's) then gives it in place of the rule's; without an entry, the rule's."""
    from dataclasses import replace

    from lora.core import tuning
    from shaderdsl import interp
    dev = interp.Device(subgroup_size=32, limits=H200)
    params = dict(in_dim=32, out_dim=32, tokens=16, bias=False)
    rule = tuning.product_tiling(dev, "dense", params)
    assert rule == base_tiling("dense", H200, **params) and (rule.rows, rule.cols) == (64, 64)
    said = []
    other = replace(rule, k_step=32)
    best = tuning.autotune_product(dev, "dense", params, cands=[rule, other],
                                   progress=said.append)
    assert best in (rule, other) and len(said) == 2
    assert tuning.product_tiling(dev, "dense", params) == best
    assert tuning.product_tiling(dev, "dense", dict(params, tokens=32)) == \
        base_tiling("dense", H200, **dict(params, tokens=32))
