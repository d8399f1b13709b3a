"""Command line: ``python -m lora {wgsl,demo,check,bench,train,export}``.

    python -m lora wgsl fused_forward --rank 8 --in-dim 2560 --out-dim 2560 --scale 2.0
    python -m lora demo            # the seed case on the default adapter, every path
    python -m lora check           # every kernel and path once against numpy
    python -m lora bench ...       # lora.apps.bench (benchmarks)
    python -m lora train ...       # lora.apps.train_cli (fine-tune on scikit-learn's digits)
    python -m lora finetune-lm ... # lora.apps.finetune_lm (a causal LM folder on a text file)
    python -m lora export --out web/  # the forward as an ES module for web pages (lora.apps.web)
    python -m lora export --demo web/ # a self-contained page running it in the browser

The parser and ``wgsl`` are here; each other command has its module
(``demo_cli``, ``check_cli``, ``export_cli``, ``bench``, ``train_cli``,
``finetune_lm``).
"""
from __future__ import annotations

import argparse
import ast
import sys

from ..core.shape import LayerShape
from ..kernels import KERNELS
from . import export_cli

# The kernels ``wgsl`` builds from its shape options (--rank, --in-dim, ...); every
# kernel of lora.kernels.KERNELS takes name=value parameters.
SHAPE_OPTION_KERNELS = ("project_a", "project_b", "add_scaled", "fused_b_add", "fused_forward",
                        "tiled_forward")


def build_kernel(name: str, shape: LayerShape, projection: str = "workgroup", threads: int = 256,
                 outputs_per_thread: int = 1, subgroups: bool = False, tile_tokens: int = 16,
                 rank_group: int = 0, token_block: int = 1):
    """The Kernel a plan would dispatch for ``shape`` (its tokens baked) and
    these options (lora.kernels.KERNELS)."""
    if name not in SHAPE_OPTION_KERNELS:
        raise ValueError(f"unknown kernel {name!r}; expected one of {SHAPE_OPTION_KERNELS}")
    if rank_group < 0:
        raise ValueError(f"rank_group must be >= 0 (0: all ranks in one workgroup), got "
                         f"{rank_group}")
    if shape.tokens is None:
        raise ValueError("build_kernel bakes the token count: give LayerShape.tokens")
    if name == "project_a" and projection == "seed":
        name = "project_a_seed"
    given = dict(rank=shape.rank, in_dim=shape.in_dim, out_dim=shape.out_dim, scale=shape.scale,
                 tokens=shape.tokens, dtype=shape.dtype, threads=threads,
                 outputs_per_thread=outputs_per_thread, subgroups=subgroups,
                 tile_tokens=tile_tokens, token_block=token_block,
                 rank_group=rank_group if 0 < rank_group < shape.rank else 0,
                 num_elements=shape.tokens * shape.out_dim)
    spec = KERNELS[name]
    return spec.kernel(**{k: v for k, v in given.items() if k in spec.parameter_names})


def _registry_kernel(name: str, params: list[str]):
    """Any kernel of lora.kernels.KERNELS from name=value parameters (Python literals)."""
    given = {}
    for item in params:
        key, eq, text = item.partition("=")
        if not eq:
            raise ValueError(f"parameter {item!r} is not name=value")
        try:
            given[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            given[key] = text
    try:
        return KERNELS[name].kernel(**given)
    except TypeError as e:
        raise ValueError(str(e)) from None


def _wgsl_kernel(args):
    """The Kernel ``wgsl`` prints: from name=value parameters, or from the shape options."""
    if args.kernel not in SHAPE_OPTION_KERNELS or args.params:
        return _registry_kernel(args.kernel, args.params)
    shape = LayerShape(rank=args.rank, in_dim=args.in_dim, out_dim=args.out_dim,
                       tokens=args.tokens, dtype=args.dtype, scale=args.scale)
    return build_kernel(args.kernel, shape, args.projection, threads=args.threads,
                        outputs_per_thread=args.outputs_per_thread, subgroups=args.subgroups,
                        tile_tokens=args.tile_tokens, rank_group=args.rank_group,
                        token_block=args.token_block)


def cmd_wgsl(args) -> int:
    from shaderdsl.errors import ShaderDSLError

    if args.kernel in SHAPE_OPTION_KERNELS and not args.params:
        for what in ("rank", "in_dim", "out_dim", "tokens", "threads", "outputs_per_thread",
                     "token_block"):
            if getattr(args, what) < 1:
                print(f"error: --{what.replace('_', '-')} must be >= 1", file=sys.stderr)
                return 2
    try:
        kernel = _wgsl_kernel(args)
    except (ShaderDSLError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(kernel.wgsl, end="")
    if args.info:
        print(f"// workgroup_size: {kernel.workgroup_size}")
        print(f"// features: {sorted(kernel.features)}")
        for b in kernel.bindings:
            print(f"// binding {b.index}: {b.name} {b.access} {b.elem} length={b.length}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lora",
                                description="LoRA forward on WebGPU: print kernels, run the demo, "
                                            "self-check, benchmark.")
    sub = p.add_subparsers(dest="command", required=True)

    w = sub.add_parser("wgsl", help="print the WGSL of one LoRA kernel")
    w.add_argument("kernel", choices=sorted(KERNELS),
                   help="a kernel of lora.kernels.KERNELS; the forward ones also take the "
                        "options below, every one takes name=value parameters")
    w.add_argument("params", nargs="*", metavar="name=value",
                   help="the kernel function's parameters, e.g. out_dim=64 rank=4 (Python "
                        "literals)")
    w.add_argument("--rank", type=int, default=8)
    w.add_argument("--in-dim", type=int, default=2560)
    w.add_argument("--out-dim", type=int, default=2560)
    w.add_argument("--scale", type=float, default=2.0)
    w.add_argument("--tokens", type=int, default=1)
    w.add_argument("--projection", choices=("workgroup", "seed"), default="workgroup",
                   help="project_a only: one workgroup per token, or Hesper's one thread per h")
    w.add_argument("--threads", type=int, default=256, help="workgroup size (default 256)")
    w.add_argument("--outputs-per-thread", type=int, default=1, help="fused_forward only")
    w.add_argument("--subgroups", action="store_true",
                   help="project_a/fused_forward: reduce with subgroupAdd")
    w.add_argument("--tile-tokens", type=int, default=16, help="tiled_forward only")
    w.add_argument("--token-block", type=int, default=1,
                   help="tiled_forward only: tokens per thread while computing h (default 1)")
    w.add_argument("--rank-group", type=int, default=0,
                   help="project_a only: ranks per workgroup (default 0: all)")
    w.add_argument("--dtype", choices=("f32", "f16"), default="f32",
                   help="storage of A, B, x and output (default f32)")
    w.add_argument("--info", action="store_true", help="also print bindings and features")

    d = sub.add_parser("demo", help="run the seed case through every path; errors and timings")
    d.add_argument("--rank", type=int, default=8)
    d.add_argument("--dim", type=int, default=2560, help="in_dim = out_dim (default 2560)")
    d.add_argument("--tokens", type=int, default=1)
    d.add_argument("--alpha", type=float, default=16.0, help="default 16: scale 2 at rank 8")
    d.add_argument("--repeat", type=int, default=200, help="forwards per timed batch")
    d.add_argument("--trials", type=int, default=5, help="timed batches (median reported)")
    d.add_argument("--seed", type=int, default=0)

    sub.add_parser("check", help="run every kernel and path once against numpy; exit 1 on failure")
    export_cli.add_parser(sub)
    sub.add_parser("bench", help="benchmarks (lora.apps.bench); arguments go to it", add_help=False)
    sub.add_parser("train", help="fine-tune LoRA adapters on scikit-learn's digits "
                                 "(lora.apps.train_cli)", add_help=False)
    sub.add_parser("finetune-lm", help="fine-tune LoRA adapters of a causal LM folder on a text "
                                       "file (lora.apps.finetune_lm)", add_help=False)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from .bench import main as bench
        rc = bench(argv[1:])
        return 0 if rc is None else int(rc)
    if argv and argv[0] == "train":
        from .train_cli import main as train
        return train(argv[1:])
    if argv and argv[0] == "finetune-lm":
        from .finetune_lm import main as finetune_lm
        return finetune_lm(argv[1:])
    args = parser().parse_args(argv)
    if args.command == "wgsl":
        return cmd_wgsl(args)
    for what in ("rank", "dim", "in_dim", "out_dim", "tokens", "repeat", "trials"):
        if getattr(args, what, 1) < 1:
            print(f"error: --{what.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.command == "export":
        args.argv = argv
        return export_cli.cmd_export(args)
    if args.command == "demo":
        from .demo_cli import cmd_demo
        return cmd_demo(args)
    from .check_cli import cmd_check
    return cmd_check(args)


if __name__ == "__main__":
    sys.exit(main())
