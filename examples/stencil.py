"""A 2-D convolution (a stencil) through a workgroup tile with a halo.

What it shows:

* ``m.shared(f32, (rows, cols))``: a workgroup tile indexed ``tile[r, c]``,
  here the workgroup's block of the image plus a border of ``radius``
  pixels on every side (the halo) that the neighbouring blocks own;
* a cooperative load: the tile has more cells than the workgroup has
  invocations, so each invocation strides over them (``m.loop`` from
  ``local_index`` by the workgroup's size), then one ``m.barrier()``;
* ``i32`` coordinates for the cells left of and above the image, which
  read as zero (the guard compares them with 0 before the buffer is read);
* Python loops over the (2r+1)^2 taps: unrolled, constant offsets in the WGSL.

Run ``python -m examples.stencil`` to see the WGSL and the error against numpy.
On the interpreter device, the same kernel without its ``m.barrier()``
raises ``RaceError`` naming the line that loads the tile and the line that
reads a tap (tests/test_examples_interp.py checks it).
"""
from __future__ import annotations

import numpy as np

import shaderdsl as sd
from shaderdsl import f32, i32

TILE = 8


def conv2d(m, height, width, radius):
    """``out[y, x] = sum w[dy, dx] * img[y + dy - r, x + dx - r]``, zero outside the image."""
    img = m.declare_input_buffer("img", f32, (height, width))
    taps = 2 * radius + 1
    w = m.declare_input_buffer("w", f32, (taps, taps))
    out = m.declare_output_buffer("out", f32, (height, width))
    tx, ty = m.workgroup_size[0], m.workgroup_size[1]
    side_x, side_y = tx + 2 * radius, ty + 2 * radius
    tile = m.shared(f32, (side_y, side_x), name="tile")
    left = m.let(i32(m.workgroup_id().x * tx) - radius, "left")
    top = m.let(i32(m.workgroup_id().y * ty) - radius, "top")
    with m.loop(m.local_index(), side_x * side_y, tx * ty, name="cell") as cell:
        r, c = m.let(cell / side_x, "r"), m.let(cell % side_x, "c")
        y, x = m.let(top + i32(r), "y"), m.let(left + i32(c), "x")
        pixel = m.var(f32, 0.0, "pixel")
        with m.if_((y >= 0) & (y < height) & (x >= 0) & (x < width)):
            m.assign(pixel, img[y, x])
        tile[r, c] = pixel
    m.barrier()  # every cell of the tile is loaded before any invocation reads its taps
    lx, ly = m.local_id().x, m.local_id().y
    acc = m.var(f32, 0.0, "acc")
    for dy in range(taps):
        for dx in range(taps):
            acc += w[dy, dx] * tile[ly + dy, lx + dx]
    gx, gy = m.global_id().x, m.global_id().y
    with m.if_((gx < width) & (gy < height)):
        out[gy, gx] = acc


def run(device, img, weights, tile=TILE):
    """Convolve the float32 image ``img`` [h, w] with the square ``weights``
    (an odd side); the output is NaN-poisoned first."""
    height, width = img.shape
    radius = weights.shape[0] // 2
    k = sd.compile(conv2d, (tile, tile), height=height, width=width, radius=radius)
    out = device.buffer(np.full_like(img, np.nan))
    device.dispatch(k, {"img": device.buffer(img), "w": device.buffer(weights), "out": out},
                    (-(-width // tile), -(-height // tile)))
    return device.read(out)


def reference(img, weights):
    """The convolution in float64 with numpy (zero padding)."""
    r = weights.shape[0] // 2
    height, width = img.shape
    padded = np.pad(np.asarray(img, np.float64), r)
    return sum(float(weights[dy, dx]) * padded[dy:dy + height, dx:dx + width]
               for dy in range(2 * r + 1) for dx in range(2 * r + 1))


def main() -> None:
    from shaderdsl.runtime import get_device
    rng = np.random.default_rng(0)
    img = rng.standard_normal((37, 50)).astype(np.float32)
    weights = rng.random((3, 3)).astype(np.float32)
    print(sd.compile(conv2d, (TILE, TILE), height=37, width=50, radius=1).wgsl)
    got = run(get_device(), img, weights)
    print("max abs error vs float64:", np.abs(got - reference(img, weights)).max())


if __name__ == "__main__":
    main()
