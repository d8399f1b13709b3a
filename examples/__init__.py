"""Worked examples of shaderdsl, one kernel family per module.

Each module has kernel function(s) ``fn(m, **params)``, a ``run(device, ...)``
helper (numpy in, numpy out) and a ``main()`` that prints the WGSL and the
error against numpy:

    python -m examples.saxpy        # elementwise y = a*x + y; override vs uniform
    python -m examples.reduction    # workgroup tree reduction, subgroup variant
    python -m examples.matmul       # tiled matrix multiply in workgroup memory
    python -m examples.histogram    # atomics, global and workgroup-private
    python -m examples.half         # f16 storage, f32 accumulation
    python -m examples.int8_matmul  # int8 matrices, packed dot4I8Packed, exact i32 sums

Print only the WGSL of a kernel with the CLI:

    python -m shaderdsl wgsl examples.saxpy:saxpy n=100
    python -m shaderdsl wgsl examples.matmul:matmul M=100 K=50 N=70 --workgroup-size 8,8
"""
