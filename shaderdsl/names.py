"""Identifier rules: WGSL keywords, reserved words and predeclared names.

A buffer called ``target`` broke a Hesper kernel; here such a name is refused
when it is declared, with the reason.
"""
from __future__ import annotations

import re

from .ops import spellings

# WGSL keywords and reserved words (WGSL spec, sections "Keyword Summary" and
# "Reserved Words").
RESERVED = frozenset("""
alias break case const const_assert continue continuing default diagnostic discard
else enable false fn for if let loop override requires return struct switch true var
while NULL Self abstract active alignas alignof as asm asm_fragment async attribute
auto await become cast catch class co_await co_return co_yield coherent column_major
common compile compile_fragment concept const_cast consteval constexpr constinit crate
debugger decltype delete demote demote_to_helper do dynamic_cast enum explicit export
extends extern external fallthrough filter final finally friend from fxgroup get goto
groupshared highp impl implements import inline instanceof interface layout lowp macro
macro_rules match mediump meta mod module move mut mutable namespace new nil noexcept
noinline nointerpolation non_coherent noncoherent noperspective null nullptr of
operator package packoffset partition pass patch pixelfragment precise precision
premerge priv protected pub public readonly ref regardless register reinterpret_cast
require resource restrict self set shared signed sizeof smooth snorm static
static_assert static_cast std subroutine super target template this thread_local
throw trait try type typedef typeid typename typeof union unless unorm unsafe unsized
use using varying virtual volatile wgsl where with writeonly yield
""".split())

# Predeclared types, address spaces and builtin functions: legal to shadow in
# WGSL, but a buffer named `min` or `f32` makes the generated code unreadable
# and breaks every later use of the builtin, so they are refused too. The
# functions the DSL offers come from the operation registry; these are the rest.
WGSL_TYPES_AND_SPACES = frozenset("""
bool f16 f32 i32 u32 vec2 vec3 vec4 mat2x2 mat2x3 mat2x4 mat3x2 mat3x3 mat3x4 mat4x2
mat4x3 mat4x4 array atomic ptr sampler sampler_comparison texture_1d texture_2d
texture_3d texture_cube texture_storage_2d read write read_write function private
workgroup uniform storage main
""".split())
OTHER_WGSL_FUNCTIONS = frozenset("""
acos acosh asin asinh atan atan2 atanh bitcast cosh countLeadingZeros countTrailingZeros
degrees determinant extractBits faceForward frexp insertBits ldexp modf quantizeToF16
radians reflect refract sinh transpose workgroupBarrier storageBarrier textureBarrier
atomicCompareExchangeWeak subgroupElect subgroupExclusiveMul subgroupInclusiveMul
""".split())
PREDECLARED = WGSL_TYPES_AND_SPACES | OTHER_WGSL_FUNCTIONS | spellings()

_IDENT = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


def check_user_name(name: str) -> str | None:
    """Why ``name`` cannot name a declaration, or None if it can.

    Names starting with '_' are kept for generated names.
    """
    if not isinstance(name, str):
        return f"a name must be a str, got {type(name).__name__}"
    if not _IDENT.match(name):
        return (f"{name!r} is not a usable identifier (letters, digits and '_', starting "
                f"with a letter; a leading '_' is kept for generated names)")
    if name in RESERVED:
        return f"{name!r} is a WGSL keyword or reserved word"
    if name in PREDECLARED:
        return f"{name!r} is a predeclared WGSL type or builtin function name"
    return None
