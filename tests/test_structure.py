"""The shape of the code: imports flow one way, functions read at once, each
operation defined once (docs and names derived from the registry), lora's
kernels print without wgpu, and plans go with their weight."""
from __future__ import annotations

import ast
import gc
import re
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shaderdsl", "lora")
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imported(module: str, path: Path, known: dict) -> set[str]:
    """Modules of ours that ``module`` imports anywhere (function-level imports too):
    ``from pkg import sub`` counts as importing ``pkg.sub``, not the package's face."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            names = names or [base]
        else:
            continue
        found |= {n for n in names if n in known}
    # a package's __init__ importing its own submodules is its face, not a cycle
    return {m for m in found if m != module and not (path.name == "__init__.py"
                                                     and m.startswith(module + "."))}


def test_no_import_cycles():
    known = modules()
    graph = {m: imported(m, p, known) for m, p in known.items()}
    cycles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join(trail + [start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))


def layer_table() -> list[tuple[str, set[str]]]:
    """docs/architecture.md's layer tables, bottom layer first: (layer, modules).
    A table follows a heading naming its package (### `shaderdsl`); in its
    modules column `name` is a module of that package, `name/` a sub-package
    with every module in it."""
    known, rows, package = modules(), [], None
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        heading = re.fullmatch(r"### `(\w+)`.*", line)
        if heading:
            package = heading.group(1)
        elif package and line.startswith("| ") and "---" not in line and \
                not line.startswith("| layer "):
            layer, cell = [c.strip() for c in line.split("|")[1:3]]
            names = set()
            for token in re.findall(r"`([\w./]+)`", cell):
                dotted = token.rstrip("/").replace("/", ".")
                name = package if token == "." else f"{package}.{dotted}"
                names |= {m for m in known if m == name or
                          (token.endswith("/") and m.startswith(name + "."))}
            rows.append((f"{package}: {layer}", names))
    return rows


def test_the_layer_table_covers_every_module_once():
    rows = layer_table()
    counted = [m for _, names in rows for m in names]
    assert sorted(set(counted)) == sorted(modules()), \
        ("not in the table", sorted(set(modules()) - set(counted)))
    assert len(counted) == len(set(counted)), "in two rows: " + ", ".join(
        sorted({m for m in counted if counted.count(m) > 1}))


def test_imports_follow_the_layer_table():
    """A module imports only modules of its own layer or of layers below it
    (earlier rows of docs/architecture.md), lazy imports included."""
    known = modules()
    level = {m: i for i, (_, names) in enumerate(layer_table()) for m in names}
    names = [layer for layer, _ in layer_table()]
    upward = [f"{m} ({names[level[m]]}) imports {n} ({names[level[n]]})"
              for m, path in known.items() for n in imported(m, path, known)
              if level[n] > level[m]]
    assert not upward, "imports up the layer table:\n" + "\n".join(sorted(upward))


def test_the_runtime_builds_no_tree():
    known = modules()
    for mod, path in known.items():
        if mod.startswith("shaderdsl.runtime"):
            forbidden = {"shaderdsl.builder", "shaderdsl.expr", "shaderdsl.nodes", "shaderdsl.emit"}
            assert not imported(mod, path, known) & forbidden, mod


def test_no_long_functions():
    long = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "functions over 60 lines:\n" + "\n".join(long)


def test_lora_kernels_print_without_wgpu():
    probe = ("import sys; sys.modules['wgpu'] = None\n"
             "import lora, lora.kernels as K, shaderdsl\n"
             "k = K.KERNELS['tiled_forward'].kernel(rank=8, in_dim=64, out_dim=64, scale=2.0,"
             " tokens=40, threads=64, tile_tokens=8)\n"
             "print(k.wgsl.splitlines()[0], lora.Strategy.parse('tiled:64:8'))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["//", "kernel", "tiled_forward", "tiled(threads=64,",
                                "tile_tokens=8)"]


def test_builtin_table_in_the_docs_is_the_registry():
    """docs/dsl.md 3.8 names every builtin function the registry has, and no other."""
    from shaderdsl import builtins as B
    from shaderdsl.ops import BUILTINS

    text = (ROOT / "docs" / "dsl.md").read_text()
    table = text[text.index("### 3.8"):text.index("### 3.9")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    documented = set()
    for row in rows[1:]:
        documented |= set(re.findall(r"`([a-z_0-9]+)(?:\(|`)", row.split("|")[2]))
    documented -= {"u32", "i32"}  # types named in the notes of a row
    assert documented == set(BUILTINS), (sorted(documented - set(BUILTINS)),
                                         sorted(set(BUILTINS) - documented))
    assert all(callable(getattr(B, name)) for name in BUILTINS)


# The builtin functions of the WGSL spec (section "Built-in Functions": numeric,
# logical, array, bit, packing, atomic, synchronization, subgroup and quad) and of
# Chromium's subgroup-matrix extension, written here from the spec, not from the
# registry, so that both the registry's spellings and the refused names are checked
# against something that neither is built from.
WGSL_BUILTIN_FUNCTIONS = frozenset("""
bitcast all any select arrayLength abs acos acosh asin asinh atan atanh atan2 ceil clamp
cos cosh countLeadingZeros countOneBits countTrailingZeros cross degrees determinant
distance dot dot4U8Packed dot4I8Packed exp exp2 extractBits faceForward firstLeadingBit
firstTrailingBit floor fma fract frexp insertBits inverseSqrt ldexp length log log2 max
min mix modf normalize pow quantizeToF16 radians reflect refract reverseBits round
saturate sign sin sinh smoothstep sqrt step tan tanh transpose trunc
pack4x8snorm pack4x8unorm pack4xI8 pack4xU8 pack4xI8Clamp pack4xU8Clamp pack2x16snorm
pack2x16unorm pack2x16float unpack4x8snorm unpack4x8unorm unpack4xI8 unpack4xU8
unpack2x16snorm unpack2x16unorm unpack2x16float
atomicLoad atomicStore atomicAdd atomicSub atomicMax atomicMin atomicAnd atomicOr atomicXor
atomicExchange atomicCompareExchangeWeak storageBarrier textureBarrier workgroupBarrier
subgroupAdd subgroupExclusiveAdd subgroupInclusiveAdd subgroupAll subgroupAnd subgroupAny
subgroupBallot subgroupBroadcast subgroupBroadcastFirst subgroupElect subgroupMax
subgroupMin subgroupMul subgroupExclusiveMul subgroupInclusiveMul subgroupOr
subgroupShuffle subgroupShuffleDown subgroupShuffleUp subgroupShuffleXor subgroupXor
subgroupMatrixLoad subgroupMatrixStore subgroupMatrixMultiply
subgroupMatrixMultiplyAccumulate
""".split())


def test_registry_spellings_are_wgsl_builtins():
    """Every function the registry emits is spelled as the spec spells it (a
    misspelt ``op.wgsl`` would only fail when a shader compiler reads it)."""
    from shaderdsl.ops import BUILTINS

    emitted = {op.wgsl.partition("<")[0] for op in BUILTINS.values() if "{" not in op.wgsl}
    assert emitted - WGSL_BUILTIN_FUNCTIONS == set()


def test_wgsl_builtins_cannot_name_a_declaration():
    from shaderdsl.names import check_user_name

    assert {name for name in WGSL_BUILTIN_FUNCTIONS if not check_user_name(name)} == set()


def test_plan_buffers_go_with_their_weight(device):
    """A cached plan holds the weight's buffers, not the weight: dropping the
    weight frees the plan and its scratch buffers."""
    import lora

    rng = np.random.default_rng(0)
    w = lora.Weight.from_numpy(device, rng.standard_normal((4, 32)), rng.standard_normal((24, 4)))
    x = device.buffer(rng.standard_normal((3, 32)).astype(np.float32))
    out = device.buffer(np.zeros((3, 24), np.float32))
    lora.execute_lora_forward_auto(device, w, 1.0, x, out, strategy="split:64")
    (plan,) = set(w.plans.values())  # (one plan, under the facade's key and auto_plan's)
    scratch = weakref.ref(plan.h)
    plan_ref = weakref.ref(plan)
    del plan, w
    gc.collect()
    assert plan_ref() is None and scratch() is None
    assert not np.isnan(device.read(out)).any()


def test_one_python_version_everywhere():
    """The oldest Python we support is written three times in pyproject.toml
    (install, ruff, pyright): the three agree, so the gate checks the code
    against the Python it promises to run on."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    requires = config["project"]["requires-python"]
    assert re.fullmatch(r">=3\.\d+", requires), requires
    version = requires.removeprefix(">=")
    assert config["tool"]["pyright"]["pythonVersion"] == version
    assert config["tool"]["ruff"]["target-version"] == "py" + version.replace(".", "")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
