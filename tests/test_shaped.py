"""Shaped buffers and workgroup arrays: ``x[r, c]`` indexing with the strides in
the WGSL, sizes from ints, overrides or uniforms, and per-axis checks in the
interpreter."""
import numpy as np
import pytest

import shaderdsl as sd
from shaderdsl import f32, i32, interp, u32
from shaderdsl.errors import OutOfBoundsError, ShaderTypeError

TILE = 8


def padded_transpose(m, rows, cols):
    """The classic tiled transpose: a (TILE, TILE + 1) tile keeps columns in
    different banks."""
    x = m.declare_input_buffer("x", f32, (rows, cols))
    y = m.declare_output_buffer("y", f32, (cols, rows))
    tile = m.shared(f32, (TILE, TILE + 1))
    lid, wid = m.local_id(), m.workgroup_id()
    r, c = m.let(wid.y * TILE + lid.y, "r"), m.let(wid.x * TILE + lid.x, "c")
    with m.if_((r < rows) & (c < cols)):
        tile[lid.y, lid.x] = x[r, c]
    m.barrier()
    tr, tc = m.let(wid.x * TILE + lid.y, "tr"), m.let(wid.y * TILE + lid.x, "tc")
    with m.if_((tr < cols) & (tc < rows)):
        y[tr, tc] = tile[lid.x, lid.y]


def gather_3d(m):
    """Sizes from an override (depth) and a uniform (cols): the strides are
    expressions in the WGSL."""
    depth = m.override("depth", u32, 3)
    cols = m.declare_uniform("cols", u32)
    x = m.declare_input_buffer("x", f32, (depth, 4, cols))
    y = m.declare_output_buffer("y", f32)
    i = m.global_id().x
    with m.if_(i < depth * 4 * cols):
        d, rest = m.let(i / (4 * cols), "d"), m.let(i % (4 * cols), "rest")
        y[i] = x[d, rest / cols, rest % cols] * 2.0


@pytest.mark.parametrize("rows, cols", [(5, 7), (16, 24), (17, 9)])
def test_padded_transpose_matches_numpy(device, rows, cols):
    rng = np.random.default_rng(rows * cols)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    k = sd.compile(padded_transpose, (TILE, TILE, 1), rows=rows, cols=cols)
    assert f"x[r * {cols}u + c]" in k.wgsl and f"array<f32, {TILE * (TILE + 1)}>" in k.wgsl
    assert k.bindings[0].shape == (rows, cols) and k.bindings[1].shape == (cols, rows)
    xb, yb = device.buffer(x), device.empty((cols, rows), np.float32)
    grid = (-(-cols // TILE), -(-rows // TILE), 1)
    device.dispatch(k, {"x": xb, "y": yb}, grid)
    assert np.array_equal(device.read(yb), x.T)  # a copy: exact
    cpu = interp.run(padded_transpose, (TILE, TILE, 1), grid,
                     {"x": x, "y": np.zeros((cols, rows), np.float32)}, rows=rows, cols=cols)
    assert np.array_equal(cpu["y"], x.T)


def test_sizes_from_an_override_and_a_uniform(device):
    depth, cols = 2, 5
    rng = np.random.default_rng(3)
    x = rng.standard_normal((depth, 4, cols)).astype(np.float32)
    k = sd.compile(gather_3d, 64)
    assert "x[d * (4u * cols) + (rest / cols * cols + rest % cols)]" in k.wgsl
    assert k.bindings[1].shape == ("depth", 4, "cols")
    n = x.size
    yb = device.empty(n, np.float32)
    device.dispatch(k, {"x": device.buffer(x), "y": yb, "cols": device.uniform(np.uint32(cols))}, 1,
                    overrides={"depth": depth})
    np.testing.assert_array_equal(device.read(yb), 2 * x.ravel())
    cpu = interp.run(gather_3d, 64, 1, {"x": x.ravel(), "y": np.zeros(n, np.float32),
                                        "cols": np.uint32(cols)}, overrides={"depth": depth})
    np.testing.assert_array_equal(cpu["y"], 2 * x.ravel())


def test_the_interpreter_checks_each_axis():
    """x[0, 4] of a (4, 4) buffer is element 4, inside the buffer, but past the
    columns: the interpreter names the axis."""
    def past_the_columns(m):
        x = m.declare_input_buffer("x", f32, (4, 4))
        y = m.declare_output_buffer("y", f32)
        i = m.global_id().x
        y[i] = x[0, i]

    with pytest.raises(OutOfBoundsError, match=r"index 4 on axis 1 .* shape \(4, 4\)"):
        interp.run(past_the_columns, 8, 1, {"x": np.zeros(16, np.float32),
                                            "y": np.zeros(8, np.float32)})


def test_an_i32_index_is_converted():
    def k(m):
        x = m.declare_input_buffer("x", f32, (3, 4))
        y = m.declare_output_buffer("y", f32)
        j = m.let(i32(m.global_id().x), "j")
        y[0] = x[j, 1]

    assert "x[u32(j) * 4u + 1u]" in sd.compile(k, 1).wgsl


@pytest.mark.parametrize("body, message", [
    (lambda m, x: x[1], r"shape \(3, 4\): index it with 2 indices, got 1"),
    (lambda m, x: x[1, 2, 3], r"index it with 2 indices, got 3"),
    (lambda m, x: x[3, 0], r"index 3 is out of range for axis 0 of `x` \(size 3\)"),
    (lambda m, x: x[0, f32(1.0)], r"an index must be u32 or i32, got f32 on axis 1"),
    (lambda m, x: m.declare_input_buffer("z", f32)[1, 2], r"`z` has no shape"),
])
def test_bad_indices_are_refused_at_the_line(body, message):
    def k(m):
        x = m.declare_input_buffer("x", f32, (3, 4))
        y = m.declare_output_buffer("y", f32)
        y[0] = body(m, x)

    with pytest.raises(ShaderTypeError, match=message):
        sd.compile(k, 1)


@pytest.mark.parametrize("shape, message", [
    ((), "a shape needs at least one size"),
    ((3, 0), "each size of a shape must be a positive int"),
    ((3, 2.5), "each size of a shape must be a positive int"),
])
def test_bad_shapes_are_refused(shape, message):
    def k(m):
        m.declare_input_buffer("x", f32, shape)

    with pytest.raises(ShaderTypeError, match=message):
        sd.compile(k, 1)


def test_a_shared_shape_needs_ints():
    def k(m):
        m.shared(f32, (4, m.override("n", u32, 2)))

    with pytest.raises(ShaderTypeError, match="positive int length or a shape of them"):
        sd.compile(k, 1)


def test_numpy_sizes_build_the_same_kernel():
    a = sd.compile(padded_transpose, (TILE, TILE, 1), rows=5, cols=7)
    b = sd.compile(padded_transpose, (TILE, TILE, 1), rows=np.int64(5), cols=np.int32(7))
    assert a.wgsl == b.wgsl


def rows_of_vec4(m, rows, cols):
    x = m.declare_input_buffer("x", sd.vec4f, (rows, cols))
    y = m.declare_output_buffer("y", sd.vec4f, (rows, cols))
    r, c = m.global_id().y, m.global_id().x
    with m.if_((r < rows) & (c < cols)):
        y[r, c] = x[r, c]


@pytest.mark.parametrize("make", ["gpu", "interp"])
def test_a_buffer_whose_rows_differ_from_the_shape_is_refused(device, make):
    """A (6, 4) array bound to a (4, 6) binding (transposed by mistake) ran,
    read with the wrong strides; now BindingError names the binding, both
    shapes and the axis. More rows, a flat array and a vector binding's
    trailing components axis still bind."""
    dev = device if make == "gpu" else interp.Device()
    k = sd.compile(padded_transpose, (TILE, TILE, 1), rows=4, cols=6)
    y = dev.zeros((6, 4), np.float32)
    with pytest.raises(sd.BindingError, match=r"binding 'x' \(@binding\(0\)\): declared with shape "
                                              r"\(4, 6\), got .* of shape \(6, 4\): axis 1 is 4, "
                                              r"not 6, .* a shape \(any, 6\) fits"):
        dev.dispatch(k, {"x": dev.buffer(np.zeros((6, 4), np.float32)), "y": y}, (1, 1, 1))
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    for given in (x, x.ravel(), np.concatenate([x, x])):
        y = dev.zeros((6, 4), np.float32)
        dev.dispatch(k, {"x": dev.buffer(given), "y": y}, (1, 1, 1))
        np.testing.assert_array_equal(dev.read(y), x.T)
    kv = sd.compile(rows_of_vec4, (TILE, TILE, 1), rows=2, cols=3)
    xv = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    yv = dev.zeros((2, 3, 4), np.float32)
    dev.dispatch(kv, {"x": dev.buffer(xv), "y": yv}, 1)
    np.testing.assert_array_equal(dev.read(yv), xv)
    with pytest.raises(sd.BindingError, match=r"axis 1 is 2, not 3"):
        dev.dispatch(kv, {"x": dev.buffer(xv.reshape(3, 2, 4)), "y": yv}, 1)


def test_a_buffer_too_small_for_a_shape_names_the_shape():
    dev = interp.Device()
    k = sd.compile(padded_transpose, (TILE, TILE, 1), rows=4, cols=6)
    want = r"buffer has 80 bytes, needs at least 96 \(\(4, 6\) = 24 x f32, stride 4\)"
    with pytest.raises(sd.BindingError, match=r"binding 'x' \(@binding\(0\)\): " + want):
        dev.dispatch(k, {"x": dev.buffer(np.zeros((4, 5), np.float32)),
                         "y": dev.zeros((6, 4), np.float32)}, 1)
