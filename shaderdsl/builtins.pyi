"""Generated from the registry (shaderdsl.ops.BUILTINS); do not edit. Regenerate:

    .venv/bin/python -c "import shaderdsl.builtins as B; B.write_stub()"
"""
from pathlib import Path

from . import types as T
from .expr import Expr, ExprLike
from .ops import Op

__all__ = [
    "call",
    "sqrt",
    "inverse_sqrt",
    "exp",
    "exp2",
    "log",
    "log2",
    "sin",
    "cos",
    "tan",
    "tanh",
    "floor",
    "ceil",
    "round",
    "trunc",
    "fract",
    "saturate",
    "pow",
    "step",
    "fma",
    "smoothstep",
    "abs",
    "sign",
    "min",
    "max",
    "clamp",
    "count_ones",
    "reverse_bits",
    "first_leading_bit",
    "first_trailing_bit",
    "normalize",
    "mix",
    "dot",
    "length",
    "distance",
    "cross",
    "select",
    "all_",
    "any_",
    "array_length",
    "bitcast",
    "dot4_i8_packed",
    "dot4_u8_packed",
    "pack4x_i8",
    "pack4x_u8",
    "pack4x_i8_clamp",
    "pack4x_u8_clamp",
    "unpack4x_i8",
    "unpack4x_u8",
    "pack4x8snorm",
    "pack4x8unorm",
    "pack2x16snorm",
    "pack2x16unorm",
    "pack2x16float",
    "unpack4x8snorm",
    "unpack4x8unorm",
    "unpack2x16snorm",
    "unpack2x16unorm",
    "unpack2x16float",
    "atomic_add",
    "atomic_sub",
    "atomic_max",
    "atomic_min",
    "atomic_and",
    "atomic_or",
    "atomic_xor",
    "atomic_exchange",
    "atomic_load",
    "atomic_store",
    "subgroup_add",
    "subgroup_mul",
    "subgroup_max",
    "subgroup_min",
    "subgroup_and",
    "subgroup_or",
    "subgroup_xor",
    "subgroup_inclusive_add",
    "subgroup_exclusive_add",
    "subgroup_broadcast_first",
    "subgroup_broadcast",
    "subgroup_shuffle",
    "subgroup_shuffle_xor",
    "subgroup_shuffle_up",
    "subgroup_shuffle_down",
    "subgroup_all",
    "subgroup_any",
    "subgroup_ballot",
    "subgroup_matrix_load",
    "subgroup_matrix_store",
    "subgroup_matrix_load_col_major",
    "subgroup_matrix_store_col_major",
    "subgroup_matrix_multiply",
    "subgroup_matrix_multiply_accumulate",
]

def call(op: Op, *args: object) -> Expr | None: ...
def stub() -> str: ...
def write_stub(path: Path = ...) -> None: ...
def sqrt(x: ExprLike, /) -> Expr:
    """WGSL ``sqrt``: 1 argument(s) of one float scalar or vector type"""
def inverse_sqrt(x: ExprLike, /) -> Expr:
    """WGSL ``inverseSqrt``: 1 argument(s) of one float scalar or vector type"""
def exp(x: ExprLike, /) -> Expr:
    """WGSL ``exp``: 1 argument(s) of one float scalar or vector type"""
def exp2(x: ExprLike, /) -> Expr:
    """WGSL ``exp2``: 1 argument(s) of one float scalar or vector type"""
def log(x: ExprLike, /) -> Expr:
    """WGSL ``log``: 1 argument(s) of one float scalar or vector type"""
def log2(x: ExprLike, /) -> Expr:
    """WGSL ``log2``: 1 argument(s) of one float scalar or vector type"""
def sin(x: ExprLike, /) -> Expr:
    """WGSL ``sin``: 1 argument(s) of one float scalar or vector type"""
def cos(x: ExprLike, /) -> Expr:
    """WGSL ``cos``: 1 argument(s) of one float scalar or vector type"""
def tan(x: ExprLike, /) -> Expr:
    """WGSL ``tan``: 1 argument(s) of one float scalar or vector type"""
def tanh(x: ExprLike, /) -> Expr:
    """WGSL ``tanh``: 1 argument(s) of one float scalar or vector type"""
def floor(x: ExprLike, /) -> Expr:
    """WGSL ``floor``: 1 argument(s) of one float scalar or vector type"""
def ceil(x: ExprLike, /) -> Expr:
    """WGSL ``ceil``: 1 argument(s) of one float scalar or vector type"""
def round(x: ExprLike, /) -> Expr:
    """WGSL ``round``: 1 argument(s) of one float scalar or vector type"""
def trunc(x: ExprLike, /) -> Expr:
    """WGSL ``trunc``: 1 argument(s) of one float scalar or vector type"""
def fract(x: ExprLike, /) -> Expr:
    """WGSL ``fract``: 1 argument(s) of one float scalar or vector type"""
def saturate(x: ExprLike, /) -> Expr:
    """WGSL ``saturate``: 1 argument(s) of one float scalar or vector type"""
def pow(x: ExprLike, y: ExprLike, /) -> Expr:
    """WGSL ``pow``: 2 argument(s) of one float scalar or vector type"""
def step(edge: ExprLike, x: ExprLike, /) -> Expr:
    """WGSL ``step``: 2 argument(s) of one float scalar or vector type"""
def fma(a: ExprLike, b: ExprLike, c: ExprLike, /) -> Expr:
    """WGSL ``fma``: 3 argument(s) of one float scalar or vector type"""
def smoothstep(low: ExprLike, high: ExprLike, x: ExprLike, /) -> Expr:
    """WGSL ``smoothstep``: 3 argument(s) of one float scalar or vector type"""
def abs(x: ExprLike, /) -> Expr:
    """WGSL ``abs``"""
def sign(x: ExprLike, /) -> Expr:
    """WGSL ``sign``"""
def min(a: ExprLike, b: ExprLike, /) -> Expr:
    """WGSL ``min``"""
def max(a: ExprLike, b: ExprLike, /) -> Expr:
    """WGSL ``max``"""
def clamp(x: ExprLike, low: ExprLike, high: ExprLike, /) -> Expr:
    """WGSL ``clamp``"""
def count_ones(x: ExprLike, /) -> Expr:
    """WGSL ``countOneBits``"""
def reverse_bits(x: ExprLike, /) -> Expr:
    """WGSL ``reverseBits``"""
def first_leading_bit(x: ExprLike, /) -> Expr:
    """WGSL ``firstLeadingBit``"""
def first_trailing_bit(x: ExprLike, /) -> Expr:
    """WGSL ``firstTrailingBit``"""
def normalize(v: ExprLike, /) -> Expr:
    """WGSL ``normalize``"""
def mix(a: ExprLike, b: ExprLike, t: ExprLike, /) -> Expr:
    """WGSL ``mix``"""
def dot(a: ExprLike, b: ExprLike, /) -> Expr:
    """WGSL ``dot``"""
def length(v: ExprLike, /) -> Expr:
    """WGSL ``length``"""
def distance(a: ExprLike, b: ExprLike, /) -> Expr:
    """WGSL ``distance``"""
def cross(a: ExprLike, b: ExprLike, /) -> Expr:
    """WGSL ``cross``"""
def select(if_false: ExprLike, if_true: ExprLike, cond: ExprLike, /) -> Expr:
    """WGSL ``select``"""
def all_(v: ExprLike, /) -> Expr:
    """WGSL ``all``"""
def any_(v: ExprLike, /) -> Expr:
    """WGSL ``any``"""
def array_length(buffer: ExprLike, /) -> Expr:
    """WGSL ``arrayLength``"""
def bitcast(t: T.WType, x: ExprLike, /) -> Expr:
    """WGSL ``bitcast<T>``: (T, x): reinterpret the bits of x as type T (same size)"""
def dot4_i8_packed(a: ExprLike, b: ExprLike, /) -> Expr:
    """WGSL ``dot4I8Packed``: (u32, u32) -> i32"""
def dot4_u8_packed(a: ExprLike, b: ExprLike, /) -> Expr:
    """WGSL ``dot4U8Packed``: (u32, u32) -> u32"""
def pack4x_i8(x: ExprLike, /) -> Expr:
    """WGSL ``pack4xI8``: (vec4<i32>) -> u32"""
def pack4x_u8(x: ExprLike, /) -> Expr:
    """WGSL ``pack4xU8``: (vec4<u32>) -> u32"""
def pack4x_i8_clamp(x: ExprLike, /) -> Expr:
    """WGSL ``pack4xI8Clamp``: (vec4<i32>) -> u32"""
def pack4x_u8_clamp(x: ExprLike, /) -> Expr:
    """WGSL ``pack4xU8Clamp``: (vec4<u32>) -> u32"""
def unpack4x_i8(x: ExprLike, /) -> Expr:
    """WGSL ``unpack4xI8``: (u32) -> vec4<i32>"""
def unpack4x_u8(x: ExprLike, /) -> Expr:
    """WGSL ``unpack4xU8``: (u32) -> vec4<u32>"""
def pack4x8snorm(x: ExprLike, /) -> Expr:
    """WGSL ``pack4x8snorm``: (vec4<f32>) -> u32"""
def pack4x8unorm(x: ExprLike, /) -> Expr:
    """WGSL ``pack4x8unorm``: (vec4<f32>) -> u32"""
def pack2x16snorm(x: ExprLike, /) -> Expr:
    """WGSL ``pack2x16snorm``: (vec2<f32>) -> u32"""
def pack2x16unorm(x: ExprLike, /) -> Expr:
    """WGSL ``pack2x16unorm``: (vec2<f32>) -> u32"""
def pack2x16float(x: ExprLike, /) -> Expr:
    """WGSL ``pack2x16float``: (vec2<f32>) -> u32"""
def unpack4x8snorm(x: ExprLike, /) -> Expr:
    """WGSL ``unpack4x8snorm``: (u32) -> vec4<f32>"""
def unpack4x8unorm(x: ExprLike, /) -> Expr:
    """WGSL ``unpack4x8unorm``: (u32) -> vec4<f32>"""
def unpack2x16snorm(x: ExprLike, /) -> Expr:
    """WGSL ``unpack2x16snorm``: (u32) -> vec2<f32>"""
def unpack2x16unorm(x: ExprLike, /) -> Expr:
    """WGSL ``unpack2x16unorm``: (u32) -> vec2<f32>"""
def unpack2x16float(x: ExprLike, /) -> Expr:
    """WGSL ``unpack2x16float``: (u32) -> vec2<f32>"""
def atomic_add(target: ExprLike, value: ExprLike, /) -> Expr:
    """WGSL ``atomicAdd``: (target, value): returns the old value"""
def atomic_sub(target: ExprLike, value: ExprLike, /) -> Expr:
    """WGSL ``atomicSub``: (target, value): returns the old value"""
def atomic_max(target: ExprLike, value: ExprLike, /) -> Expr:
    """WGSL ``atomicMax``: (target, value): returns the old value"""
def atomic_min(target: ExprLike, value: ExprLike, /) -> Expr:
    """WGSL ``atomicMin``: (target, value): returns the old value"""
def atomic_and(target: ExprLike, value: ExprLike, /) -> Expr:
    """WGSL ``atomicAnd``: (target, value): returns the old value"""
def atomic_or(target: ExprLike, value: ExprLike, /) -> Expr:
    """WGSL ``atomicOr``: (target, value): returns the old value"""
def atomic_xor(target: ExprLike, value: ExprLike, /) -> Expr:
    """WGSL ``atomicXor``: (target, value): returns the old value"""
def atomic_exchange(target: ExprLike, value: ExprLike, /) -> Expr:
    """WGSL ``atomicExchange``: (target, value): returns the old value"""
def atomic_load(target: ExprLike, /) -> Expr:
    """WGSL ``atomicLoad``"""
def atomic_store(target: ExprLike, value: ExprLike, /) -> None:
    """WGSL ``atomicStore``"""
def subgroup_add(value: ExprLike, /) -> Expr:
    """WGSL ``subgroupAdd`` (needs the 'subgroup' feature)"""
def subgroup_mul(value: ExprLike, /) -> Expr:
    """WGSL ``subgroupMul`` (needs the 'subgroup' feature)"""
def subgroup_max(value: ExprLike, /) -> Expr:
    """WGSL ``subgroupMax`` (needs the 'subgroup' feature)"""
def subgroup_min(value: ExprLike, /) -> Expr:
    """WGSL ``subgroupMin`` (needs the 'subgroup' feature)"""
def subgroup_and(value: ExprLike, /) -> Expr:
    """WGSL ``subgroupAnd`` (needs the 'subgroup' feature)"""
def subgroup_or(value: ExprLike, /) -> Expr:
    """WGSL ``subgroupOr`` (needs the 'subgroup' feature)"""
def subgroup_xor(value: ExprLike, /) -> Expr:
    """WGSL ``subgroupXor`` (needs the 'subgroup' feature)"""
def subgroup_inclusive_add(value: ExprLike, /) -> Expr:
    """WGSL ``subgroupInclusiveAdd`` (needs the 'subgroup' feature)"""
def subgroup_exclusive_add(value: ExprLike, /) -> Expr:
    """WGSL ``subgroupExclusiveAdd`` (needs the 'subgroup' feature)"""
def subgroup_broadcast_first(value: ExprLike, /) -> Expr:
    """WGSL ``subgroupBroadcastFirst`` (needs the 'subgroup' feature)"""
def subgroup_broadcast(value: ExprLike, lane: ExprLike, /) -> Expr:
    """WGSL ``subgroupBroadcast`` (needs the 'subgroup' feature)"""
def subgroup_shuffle(value: ExprLike, lane: ExprLike, /) -> Expr:
    """WGSL ``subgroupShuffle`` (needs the 'subgroup' feature)"""
def subgroup_shuffle_xor(value: ExprLike, lane: ExprLike, /) -> Expr:
    """WGSL ``subgroupShuffleXor`` (needs the 'subgroup' feature)"""
def subgroup_shuffle_up(value: ExprLike, lane: ExprLike, /) -> Expr:
    """WGSL ``subgroupShuffleUp`` (needs the 'subgroup' feature)"""
def subgroup_shuffle_down(value: ExprLike, lane: ExprLike, /) -> Expr:
    """WGSL ``subgroupShuffleDown`` (needs the 'subgroup' feature)"""
def subgroup_all(cond: ExprLike, /) -> Expr:
    """WGSL ``subgroupAll`` (needs the 'subgroup' feature)"""
def subgroup_any(cond: ExprLike, /) -> Expr:
    """WGSL ``subgroupAny`` (needs the 'subgroup' feature)"""
def subgroup_ballot(cond: ExprLike, /) -> Expr:
    """WGSL ``subgroupBallot`` (needs the 'subgroup' feature)"""
def subgroup_matrix_load(
    mtype: T.SubgroupMatrix,
    array: ExprLike,
    offset: ExprLike,
    stride: ExprLike,
    /,
) -> Expr:
    """WGSL ``subgroupMatrixLoad<T, row_major>``: (matrix type, array, offset, stride),
    row-major (needs the 'chromium-experimental-subgroup-matrix' feature)"""
def subgroup_matrix_store(
    array: ExprLike,
    offset: ExprLike,
    value: ExprLike,
    stride: ExprLike,
    /,
) -> None:
    """WGSL ``subgroupMatrixStore<row_major>``: (array, offset, matrix, stride), row-major
    (needs the 'chromium-experimental-subgroup-matrix' feature)"""
def subgroup_matrix_load_col_major(
    mtype: T.SubgroupMatrix,
    array: ExprLike,
    offset: ExprLike,
    stride: ExprLike,
    /,
) -> Expr:
    """WGSL ``subgroupMatrixLoad<T, col_major>``: (matrix type, array, offset, stride),
    col-major (needs the 'chromium-experimental-subgroup-matrix' feature)"""
def subgroup_matrix_store_col_major(
    array: ExprLike,
    offset: ExprLike,
    value: ExprLike,
    stride: ExprLike,
    /,
) -> None:
    """WGSL ``subgroupMatrixStore<col_major>``: (array, offset, matrix, stride), col-major
    (needs the 'chromium-experimental-subgroup-matrix' feature)"""
def subgroup_matrix_multiply(component: T.Scalar | str, left: ExprLike, right: ExprLike, /) -> Expr:
    """WGSL ``subgroupMatrixMultiply<T>``: (result component, left, right): left @ right (needs
    the 'chromium-experimental-subgroup-matrix' feature)"""
def subgroup_matrix_multiply_accumulate(left: ExprLike, right: ExprLike, acc: ExprLike, /) -> Expr:
    """WGSL ``subgroupMatrixMultiplyAccumulate``: (left, right, acc): left @ right + acc (needs
    the 'chromium-experimental-subgroup-matrix' feature)"""
