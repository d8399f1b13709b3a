"""shaderdsl: write WebGPU compute kernels in Python, get readable WGSL.

A kernel is a function ``fn(m, **params)`` issuing declarations and statements
on ``m`` (a ShaderM, the mirror of Hesper's shader monad); ``compile`` turns it
into a Kernel (WGSL, bindings, features); ``shaderdsl.runtime`` runs it.
"""
from . import builtins, collectives
from .builder import ShaderM
from .compiler import compile
from .errors import (
                     AliasingError,
                     BindingError,
                     DeviceLostError,
                     DispatchError,
                     FeatureError,
                     KernelBuildError,
                     NoAdapterError,
                     ShaderDSLError,
                     ShaderNameError,
                     ShaderScopeError,
                     ShaderTypeError,
                     UniformityError,
                     WGSLCompileError,
)
from .export import package_version
from .functions import function
from .kernel import Binding, Kernel, Override
from .types import (
                     Array,
                     Atomic,
                     Scalar,
                     SubgroupMatrix,
                     Vector,
                     WType,
                     array,
                     atomic,
                     bool_,
                     f16,
                     f32,
                     i32,
                     subgroup_matrix_left,
                     subgroup_matrix_result,
                     subgroup_matrix_right,
                     u32,
                     vec2,
                     vec2f,
                     vec2h,
                     vec2i,
                     vec2u,
                     vec3,
                     vec3f,
                     vec3h,
                     vec3i,
                     vec3u,
                     vec4,
                     vec4f,
                     vec4h,
                     vec4i,
                     vec4u,
)

__version__ = package_version()

__all__ = ["builtins", "collectives", "ShaderM", "compile", "AliasingError", "BindingError",
           "DeviceLostError", "DispatchError", "FeatureError", "KernelBuildError", "NoAdapterError",
           "ShaderDSLError", "ShaderNameError", "ShaderScopeError", "ShaderTypeError",
           "UniformityError", "WGSLCompileError", "package_version", "function",
           "Binding", "Kernel", "Override", "Array", "Atomic", "Scalar",
           "SubgroupMatrix", "Vector", "WType", "array", "atomic", "bool_", "f16",
           "f32", "i32", "subgroup_matrix_left", "subgroup_matrix_result",
           "subgroup_matrix_right", "u32", "vec2", "vec2f", "vec2h", "vec2i", "vec2u",
           "vec3", "vec3f", "vec3h", "vec3i", "vec3u", "vec4", "vec4f", "vec4h",
           "vec4i", "vec4u", "__version__"]
