"""Adapters: what wgpu can see, listed once per process, and the choice of one.

The device prefers discrete > integrated > others, Vulkan/Metal before D3D12
before OpenGL, unless a backend or name is asked for.
"""
from __future__ import annotations

import importlib.util
import re
import sys
import warnings

import wgpu

from ..errors import FeatureError, NoAdapterError
from ..types import SUBGROUP_MATRIX_FEATURE, MatrixConfig
from .wgpu_build import WGPU_BUILD

# Features requested whenever the adapter has them: the ones kernels may need.
WANTED_FEATURES = ("shader-f16", "subgroup", "timestamp-query", "timestamp-query-inside-passes",
                   SUBGROUP_MATRIX_FEATURE)

# Dawn's names for features that wgpu-native (and Kernel.features) spell otherwise.
DAWN_NAMES = {"subgroups": "subgroup"}

# Limits raised to the adapter's maximum (wgpu's defaults are far lower).
MAX_LIMITS = (
    "max-storage-buffer-binding-size", "max-buffer-size", "max-uniform-buffer-binding-size",
    "max-compute-workgroups-per-dimension", "max-compute-invocations-per-workgroup",
    "max-compute-workgroup-storage-size", "max-compute-workgroup-size-x",
    "max-compute-workgroup-size-y", "max-compute-workgroup-size-z",
    "max-storage-buffers-per-shader-stage", "max-uniform-buffers-per-shader-stage",
    "max-bindings-per-bind-group", "max-bind-groups", "max-immediate-size",
    "max-dynamic-uniform-buffers-per-pipeline-layout",
)

BACKENDS = {"vulkan": "Vulkan", "opengl": "OpenGL", "gl": "OpenGL", "metal": "Metal",
            "d3d12": "D3D12", "null": "Null"}
_TYPE_RANK = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}
_BACKEND_RANK = {"Vulkan": 0, "Metal": 0, "D3D12": 1, "OpenGL": 2, "OpenGLES": 2}

NO_ADAPTER_HELP = (
    "No WebGPU adapter found. To get a software one on Debian/Ubuntu, as root: "
    "`apt-get install mesa-vulkan-drivers` (lavapipe, Vulkan); or try the OpenGL "
    "backend with SHADERDSL_BACKEND=OpenGL (Mesa llvmpipe). "
    "`python -m shaderdsl adapters` lists what wgpu can see.")


class Limits(dict):
    """wgpu-py's limit dict (kebab-case keys) that also accepts WebGPU's
    camelCase and snake_case spellings: ``limits["maxBufferSize"]``."""

    @staticmethod
    def canonical(key: str) -> str:
        return re.sub(r"(?<=[a-z0-9])([A-Z])", r"-\1", key).replace("_", "-").lower()

    def __missing__(self, key):
        canon = self.canonical(key)
        if canon != key and dict.__contains__(self, canon):
            return dict.__getitem__(self, canon)
        raise KeyError(key)

    def __contains__(self, key) -> bool:
        return dict.__contains__(self, key) or dict.__contains__(self, self.canonical(key))

    def get(self, key, default=None):
        return self[key] if key in self else default


def _features(a) -> frozenset:
    """An adapter's features in wgpu-native's spelling, whichever build reports them."""
    return frozenset(DAWN_NAMES.get(f, f) for f in a.features)


_adapters: list | None = None


def all_adapters() -> list:
    """Every adapter, listed once per process: listing again while a device is
    busy races with wgpu's polling on the OpenGL backend and can abort the
    process. Dawn's Null backend answers request_adapter but not enumerate."""
    global _adapters
    if _adapters is None:
        found = list(wgpu.gpu.enumerate_adapters_sync())
        if not found:
            one = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
            found = [one] if one is not None else []
        _adapters = found
        hide_triton_beside_mesa_llvm()
    return _adapters


_opened: list = []  # adapter objects a device was opened on


def _ident(a) -> tuple:
    return a.info["device"], a.info["backend_type"], a.info["adapter_type"]


def unopened(adapter):
    """``adapter`` for opening a device on: Dawn opens one device per adapter
    object ("adapter is consumed"), so a second device on the same GPU (after
    the first was lost) needs the adapter listed anew; wgpu-native reuses it."""
    global _adapters
    if WGPU_BUILD == "dawn" and any(a is adapter for a in _opened):
        found = list(wgpu.gpu.enumerate_adapters_sync())
        adapter = next((a for a in found if _ident(a) == _ident(adapter)), adapter)
        _adapters = [adapter if _ident(a) == _ident(adapter) else a for a in _adapters or ()]
    _opened.append(adapter)
    return adapter


TRITON_HIDDEN = (
    "shaderdsl: Mesa's LLVM (loaded by the lavapipe/llvmpipe driver when adapters were "
    "listed) is now in this process, and importing triton (installed here; torch.compile's "
    "compiler, imported by peft and transformers) beside it crashes the process: triton "
    "bundles another LLVM, whose static initialisers then segfault. `import triton` now "
    "raises ImportError in this process instead; torch, peft and transformers work without "
    "it. To use triton too, import it (or torch._dynamo, or peft) before the first GPU call.")


def hide_triton_beside_mesa_llvm() -> bool:
    """Block triton's import where Mesa's libLLVM is loaded and triton is not
    yet: that import segfaults (SIGSEGV in LLVM's DebugCounter set-up, triton
    3.8 beside Mesa 22.3's LLVM 15; docs/errors.md, known issue 2). Says so
    once (RuntimeWarning); True if it blocked it."""
    if "triton" in sys.modules or not _mesa_llvm_loaded() or \
            importlib.util.find_spec("triton") is None:
        return False
    # import triton -> ModuleNotFoundError, as if not installed (a None entry blocks an
    # import, as the import system documents; typeshed types the values as modules only)
    sys.modules["triton"] = None  # pyright: ignore[reportArgumentType]
    warnings.warn(TRITON_HIDDEN, RuntimeWarning, stacklevel=3)
    return True


def _mesa_llvm_loaded() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return "/libLLVM" in maps.read()
    except OSError:  # not Linux: no Mesa driver there
        return False


def matrix_configs(a) -> tuple[MatrixConfig, ...]:
    """The shapes of an adapter's subgroup matrices (Dawn with the feature; none elsewhere)."""
    if WGPU_BUILD != "dawn" or SUBGROUP_MATRIX_FEATURE not in a.features:
        return ()
    from wgpudawn.backends.dawn import extras

    found = extras.get_adapter_properties(a).get("subgroup_matrix_configs", [])
    return tuple(MatrixConfig(c["component_type"], c["result_component_type"], c["m"], c["n"],
                              c["k"], (c["min_subgroup_size"], c["max_subgroup_size"]))
                 for c in found)


def _describe_adapter(a) -> dict:
    info = a.info
    return {"name": info["device"], "backend": info["backend_type"],
            "adapter_type": info["adapter_type"], "description": info.get("description", ""),
            "features": sorted(_features(a)), "matrix_configs": matrix_configs(a)}


def list_adapters() -> list[dict]:
    """Every adapter wgpu can see: name, backend, adapter_type, description, features."""
    return [_describe_adapter(a) for a in all_adapters()]


def adapters_report() -> str:
    """Human-readable adapter list (for ``python -m shaderdsl adapters``)."""
    rows = list_adapters()
    if not rows:
        return NO_ADAPTER_HELP
    lines = []
    for i, a in enumerate(rows):
        used = [f for f in WANTED_FEATURES if f in a["features"]]
        lines.append(f"[{i}] {a['name']}  backend={a['backend']}  type={a['adapter_type']}")
        if a["description"]:
            lines.append(f"    {a['description']}")
        lines.append(f"    shaderdsl features: {', '.join(used) or '(none)'}")
        if a["matrix_configs"]:
            lines.append("    subgroup matrices: " + ", ".join(map(str, a["matrix_configs"])))
    best = pick(all_adapters(), None, None, ())
    lines.append(f"default: {best.info['device']} ({best.info['backend_type']})")
    return "\n".join(lines)


def norm_backend(backend: str | None) -> str | None:
    if backend is None or backend == "":
        return None
    return BACKENDS.get(backend.lower(), backend)


def pick(adapters, backend: str | None, name: str | None, features):
    """The best adapter matching the filters (see module docstring for the order)."""
    all_seen = [f"{a.info['device']} ({a.info['backend_type']})" for a in adapters]
    if not adapters:
        raise NoAdapterError(NO_ADAPTER_HELP)
    cands = list(enumerate(adapters))
    if backend is not None:
        b = backend.lower()
        cands = [(i, a) for i, a in cands
                 if a.info["backend_type"].lower() == b
                 or (b == "opengl" and a.info["backend_type"].lower() == "opengles")]
    if name is not None:
        cands = [(i, a) for i, a in cands if name.lower() in a.info["device"].lower()]
    if not cands:
        want = " and ".join(x for x in (backend and f"backend {backend!r}",
                                         name and f"name containing {name!r}") if x)
        raise NoAdapterError(f"no adapter with {want}; adapters found: {all_seen}. "
                             f"Check SHADERDSL_BACKEND / SHADERDSL_ADAPTER.")
    missing_everywhere = [f for f in features if not any(f in _features(a) for _, a in cands)]
    if missing_everywhere:
        having = [f"{a.info['device']} ({a.info['backend_type']})" for a in adapters
                  if all(f in _features(a) for f in features)]
        raise FeatureError(f"no matching adapter has feature(s) {missing_everywhere}; adapters "
                           f"with all of {sorted(features)}: {having or 'none'}")
    cands = [(i, a) for i, a in cands if all(f in _features(a) for f in features)]
    if not cands:
        raise FeatureError(f"no single matching adapter has all of {sorted(features)}")

    def rank(item):
        i, a = item
        return (_TYPE_RANK.get(a.info["adapter_type"], 4),
                _BACKEND_RANK.get(a.info["backend_type"], 3), i)

    return min(cands, key=rank)[1]



def adapters_with(feature: str) -> list[str]:
    """'name (backend)' of every adapter that has ``feature`` (for error messages)."""
    try:
        return [f"{a['name']} ({a['backend']})" for a in list_adapters()
                if feature in a["features"]]
    except Exception:  # listing is only for a message
        return []
