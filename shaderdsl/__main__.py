"""Command line: ``python -m shaderdsl adapters`` and ``python -m shaderdsl wgsl MODULE:FUNCTION``."""
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
        raise SystemExit(f"error: expected MODULE:FUNCTION (e.g. examples.saxpy:saxpy), got {target!r}")
    sys.path.insert(0, ".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise SystemExit(f"error: cannot import {module_name!r}: {e}")
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise SystemExit(f"error: {module_name!r} has no function {fn_name!r}")
    return fn


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shaderdsl",
                                     description="Inspect adapters and print the WGSL of kernel functions.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("adapters", help="list WebGPU adapters with backend and features")
    w = sub.add_parser("wgsl", help="print the WGSL of a kernel function")
    w.add_argument("target", help="MODULE:FUNCTION, e.g. examples.saxpy:saxpy")
    w.add_argument("params", nargs="*", metavar="name=value",
                   help="parameters passed to the function (Python literals)")
    w.add_argument("--workgroup-size", default="64",
                   help="workgroup size, e.g. 64 or 16,16 (default 64)")
    w.add_argument("--info", action="store_true", help="also print bindings, features and cache key")
    args = parser.parse_args(argv)

    if args.command == "adapters":
        from .runtime import adapters_report
        print(adapters_report())
        return 0

    fn = _load(args.target)
    params = {}
    for item in args.params:
        name, eq, text = item.partition("=")
        if not eq or not name.isidentifier():
            parser.error(f"parameter {item!r} is not name=value")
        params[name] = _value(text)
    ws = tuple(int(v) for v in args.workgroup_size.split(","))
    try:
        kernel = compile(fn, ws, **params)
    except ShaderDSLError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(kernel.wgsl, end="")
    if args.info:
        print(f"// workgroup_size: {kernel.workgroup_size}")
        print(f"// features: {sorted(kernel.features)}")
        for b in kernel.bindings:
            print(f"// binding {b.index}: {b.name} {b.access} {b.elem} length={b.length}")
        print(f"// cache_key: {kernel.cache_key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
