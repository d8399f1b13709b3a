"""Command line: ``python -m shaderdsl adapters``, ``python -m shaderdsl wgsl MODULE:FUNCTION``
and ``python -m shaderdsl export MODULE:FUNCTION --out DIR`` (an ES module for web pages)."""
from __future__ import annotations

import argparse
import ast
import importlib
import sys

from .compiler import compile
from .errors import ShaderDSLError


def _value(text: str):
    """A command-line parameter value: a Python literal if it parses, else the string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _load(target: str):
    module_name, _, fn_name = target.partition(":")
    if not module_name or not fn_name:
        raise SystemExit(f"error: expected MODULE:FUNCTION (e.g. examples.saxpy:saxpy), "
                         f"got {target!r}")
    sys.path.insert(0, ".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise SystemExit(f"error: cannot import {module_name!r}: {e}")
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise SystemExit(f"error: {module_name!r} has no function {fn_name!r}")
    return fn


def _kernel_arguments(p) -> None:
    """The arguments naming a kernel function and its parameters (wgsl, export)."""
    p.add_argument("target", help="MODULE:FUNCTION, e.g. examples.saxpy:saxpy")
    p.add_argument("params", nargs="*", metavar="name=value",
                   help="parameters passed to the function (Python literals)")
    p.add_argument("--workgroup-size", default="64",
                   help="workgroup size, e.g. 64 or 16,16 (default 64)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m shaderdsl",
                                     description="Inspect adapters, print the WGSL of kernel "
                                                 "functions, export them for web pages.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("adapters", help="list WebGPU adapters with backend and features")
    w = sub.add_parser("wgsl", help="print the WGSL of a kernel function")
    _kernel_arguments(w)
    w.add_argument("--info", action="store_true",
                   help="also print bindings, features and cache key")
    e = sub.add_parser("export", help="write NAME.js (an ES module: WGSL, bindings, dispatch "
                                      "helper) and NAME.d.ts for a web page")
    _kernel_arguments(e)
    e.add_argument("--out", default=".", help="folder to write into (default: here)")
    e.add_argument("--name", help="file name stem (default: the kernel's name)")
    return parser


def _build(parser, args):
    """The Kernel the arguments name; exits with a message if it cannot be built."""
    fn = _load(args.target)
    params = {}
    for item in args.params:
        name, eq, text = item.partition("=")
        if not eq or not name.isidentifier():
            parser.error(f"parameter {item!r} is not name=value")
        params[name] = _value(text)
    ws = tuple(int(v) for v in args.workgroup_size.split(","))
    return compile(fn, ws, **params)


def _export(args, kernel) -> int:
    from .export import write_module

    words = ["python -m shaderdsl export", args.target, *args.params]
    if args.workgroup_size != "64":
        words.append(f"--workgroup-size {args.workgroup_size}")
    for path in write_module(kernel, args.out, " ".join(words), args.name):
        print(path)
    return 0


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "adapters":
        from .runtime import adapters_report
        print(adapters_report())
        return 0
    try:
        kernel = _build(parser, args)
    except ShaderDSLError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.command == "export":
        return _export(args, kernel)
    print(kernel.wgsl, end="")
    if args.info:
        print(f"// workgroup_size: {kernel.workgroup_size}")
        print(f"// features: {sorted(kernel.features)}")
        for b in kernel.bindings:
            shape = f" shape={tuple(b.shape)}" if b.shape and len(b.shape) > 1 else ""
            print(f"// binding {b.index}: {b.name} {b.access} {b.elem} length={b.length}{shape}")
        print(f"// cache_key: {kernel.cache_key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
