"""Export a kernel to the web: an ES module (``NAME.js``) and its TypeScript
declarations (``NAME.d.ts``).

The module holds everything a page needs and nothing from this library: the
WGSL (Tint's spelling, the one browsers compile), the binding table, the
workgroup size, the WebGPU features to request, the override constants, and
a few functions written against the standard WebGPU JavaScript API that
create and cache the pipeline and bind groups and record a dispatch. The same
runtime (``RUNTIME_JS``) serves modules of several kernels (``lora export``).
"""
from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

from .checks import expected_dtype
from .kernel import Kernel

WEB_FEATURES = {"subgroup": "subgroups"}   # Kernel.features -> WebGPU's GPUFeatureName
ARRAYS = {"float32": "Float32Array", "float16": "Uint16Array", "uint32": "Uint32Array",
          "int32": "Int32Array"}
BINDING_TYPES = {"read": "read-only-storage", "read_write": "storage", "uniform": "uniform"}


def binding_table(kernel: Kernel) -> list[dict]:
    """The bindings as plain data: what a page checks its GPUBuffers against."""
    rows = []
    for b in kernel.bindings:
        dt = expected_dtype(b)
        rows.append({"binding": b.index, "name": b.name, "access": b.access,
                     "type": BINDING_TYPES[b.access], "elem": str(b.elem),
                     "dtype": dt.name if dt is not None else None,
                     "array": ARRAYS.get(dt.name) if dt is not None else None,
                     "elemBytes": b.elem_stride, "length": b.length, "minBytes": b.min_bytes,
                     "shape": list(b.shape) if b.shape else None})
    return rows


def kernel_info(kernel: Kernel) -> dict:
    """Everything of a Kernel a page needs, as JSON-able data (WGSL last)."""
    return {"name": kernel.name, "entryPoint": kernel.entry_point,
            "workgroupSize": list(kernel.workgroup_size),
            "features": sorted(WEB_FEATURES.get(f, f) for f in kernel.features),
            "overrides": [{"name": o.name, "type": str(o.type), "default": _plain(o.default)}
                          for o in kernel.overrides],
            "workgroupBytes": kernel.workgroup_bytes,
            "bindings": binding_table(kernel), "wgsl": kernel.wgsl_for("tint")}


def _plain(value):
    """An override's default as JSON: None, a bool or a number."""
    return value if value is None or isinstance(value, (bool, int, float)) else float(value)


def template(text: str) -> str:
    """``text`` as a JavaScript template literal (readable WGSL in the module)."""
    return "`" + text.replace("\\", "\\\\").replace("`", "\\`").replace("${", "\\${") + "`"


def js_object(info: dict, indent: str = "") -> str:
    """A kernel_info dict as a JavaScript object literal: one field per line,
    one binding per line, the WGSL as a template literal."""
    inner = indent + "  "
    lines = [f"{inner}{key}: {json.dumps(value)}," for key, value in info.items()
             if key not in ("bindings", "wgsl")]
    lines.append(f"{inner}bindings: [")
    lines += [f"{inner}  {json.dumps(b)}," for b in info["bindings"]]
    lines.append(f"{inner}],")
    lines.append(f"{inner}wgsl: {template(info['wgsl'])},")
    return "{\n" + "\n".join(lines) + f"\n{indent}}}"


def buffers_type(kernel: Kernel) -> str:
    """The TypeScript interface of a dispatch's buffers, one field per binding."""
    fields = []
    for b in kernel.bindings:
        kind = "GPUBuffer | number | ArrayLike<number>" if b.access == "uniform" else "GPUBuffer"
        fields.append(f"  /** @binding({b.index}) {b.access} {b.elem}"
                      f"{f', {b.length} elements' if b.length else ''} */\n"
                      f"  {json.dumps(b.name)}: {kind};")
    return "export interface Buffers {\n" + "\n".join(fields) + "\n}\n"


def constants_type(kernel: Kernel) -> str:
    fields = [f"  {json.dumps(o.name)}?: number;  // {o.type}"
              f"{'' if o.default is not None else ', no default: required'}"
              for o in kernel.overrides]
    return "export interface Constants {\n" + "\n".join(fields) + "\n}\n"


def module_js(kernel: Kernel, command: str = "") -> str:
    """The ES module of one kernel: ``kernel``, its fields, ``dispatch``, ``prepare``."""
    head = _header(f"{kernel.name}.js", command)
    return (f"{head}\n/** The kernel: WGSL (Tint's spelling), bindings, workgroup size, "
            f"features. */\n"
            f"export const kernel = {js_object(kernel_info(kernel))};\n"
            f"export const {{name, entryPoint, workgroupSize, features, overrides, bindings, "
            f"wgsl}} = kernel;\n\n{RUNTIME_JS}\n{SINGLE_JS}")


def module_dts(kernel: Kernel, command: str = "") -> str:
    """The TypeScript declarations of ``module_js`` (WebGPU types: @webgpu/types)."""
    head = _header(f"{kernel.name}.d.ts", command)
    return (f"{head}\n{RUNTIME_DTS}\nexport declare const kernel: KernelInfo;\n"
            f"export declare const name: string, entryPoint: string, wgsl: string;\n"
            f"export declare const workgroupSize: [number, number, number];\n"
            f"export declare const features: GPUFeatureName[];\n"
            f"export declare const overrides: OverrideInfo[];\n"
            f"export declare const bindings: BindingInfo[];\n\n"
            f"{buffers_type(kernel)}\n{constants_type(kernel)}\n{SINGLE_DTS}")


def package_version() -> str:
    """shaderdsl's version as installed (pyproject.toml's), or "unknown" from a bare checkout."""
    try:
        return metadata.version("shaderdsl")
    except metadata.PackageNotFoundError:
        return "unknown"


def _header(filename: str, command: str) -> str:
    made = f"`{command}`" if command else "shaderdsl.export"
    return (f"// {filename}: generated by {made} (shaderdsl {package_version()}).\n"
            f"// Standard WebGPU only; nothing to install. See docs/browser.md.\n")


def write_module(kernel: Kernel, out_dir, command: str = "", name: str | None = None) -> list[Path]:
    """Write ``NAME.js`` and ``NAME.d.ts`` (NAME: the kernel's name) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = name or kernel.name
    js, dts = out / f"{stem}.js", out / f"{stem}.d.ts"
    js.write_text(module_js(kernel, command))
    dts.write_text(module_dts(kernel, command))
    return [js, dts]


RUNTIME_JS = r"""// ---- runtime: pipelines and bind groups made once per GPUDevice,
// checks before recording
// GPUDevice -> Map(kernel -> {module, layouts, pipelines, groups})
const perDevice = new WeakMap();

/** Throws unless ``device`` is a GPUDevice: undefined, or a Promise not yet awaited,
 *  would fail as a WeakMap key or deep inside WebGPU. */
function checkedDevice(device, kernel) {
  if (typeof device?.createShaderModule !== "function")
    throw new TypeError(`kernel ${kernel.name}: device must be a GPUDevice (from await ` +
      `adapter.requestDevice()), got ${typeof device?.then === "function" ? "a Promise " +
      "(await adapter.requestDevice() before passing the device)" : device === null ? "null" :
      device?.constructor?.name ?? typeof device}`);
  return device;
}

function stateOf(device, kernel) {
  checkedDevice(device, kernel);
  let kernels = perDevice.get(device);
  if (!kernels) perDevice.set(device, kernels = new Map());
  let s = kernels.get(kernel);
  if (!s) {
    const missing = kernel.features.filter(f => !device.features.has(f));
    if (missing.length) throw new Error(`kernel ${kernel.name} needs the WebGPU feature(s) ` +
      `${missing.join(", ")}; request them: ` +
      `adapter.requestDevice({requiredFeatures: [...]})`);
    const bindGroupLayout = device.createBindGroupLayout({entries: kernel.bindings.map(b =>
      ({binding: b.binding, visibility: GPUShaderStage.COMPUTE, buffer: {type: b.type}}))});
    s = {module: device.createShaderModule({label: kernel.name, code: kernel.wgsl}),
         bindGroupLayout, pipelines: new Map(), groups: new WeakMap(),
         layout: device.createPipelineLayout({bindGroupLayouts: [bindGroupLayout]})};
    kernels.set(kernel, s);
  }
  return s;
}

function pipelineDescriptor(kernel, s, constants) {
  return {label: kernel.name, layout: s.layout,
          compute: {module: s.module, entryPoint: kernel.entryPoint, constants}};
}

/** Compile the kernel's pipeline now; rejects with the WGSL compiler's messages. */
export async function prepareKernel(device, kernel, constants = {}) {
  const s = stateOf(device, kernel);
  // Asked once per module: Chromium never settles a second getCompilationInfo() of a module.
  s.compiled ??= s.module.getCompilationInfo().then(info => {
    const errors = info.messages.filter(m => m.type === "error");
    if (errors.length) throw new Error(`WGSL of kernel ${kernel.name}: ` +
      errors.map(m => `line ${m.lineNum}:${m.linePos}: ${m.message}`).join("; "));
  });
  await s.compiled;
  const key = JSON.stringify(Object.entries(constants).sort());
  if (!s.pipelines.has(key))
    s.pipelines.set(key, await device.createComputePipelineAsync(
      pipelineDescriptor(kernel, s, constants)));
  return s.pipelines.get(key);
}

function pipelineOf(device, kernel, s, constants) {
  const key = JSON.stringify(Object.entries(constants).sort());
  let p = s.pipelines.get(key);
  if (!p) s.pipelines.set(key, p = device.createComputePipeline(
    pipelineDescriptor(kernel, s, constants)));
  return p;
}

const UNIFORM_RANGES = {Uint32Array: [0, 2 ** 32 - 1, true],
                        Int32Array: [-(2 ** 31), 2 ** 31 - 1, true],
                        Float32Array: [-3.4028234663852886e38, 3.4028234663852886e38, false]};

/** A uniform's plain value(s), checked as the Python devices check them: numbers
 *  only, as many as the type has, integers in range for u32/i32, finite for f32. */
function uniformValues(kernel, b, value) {
  const where = `kernel ${kernel.name} binding '${b.name}' (${b.elem})`;
  const values = typeof value === "number" ? [value] : Array.from(value ?? [], v => v);
  const count = Math.max(1, Number((b.elem.match(/^vec(\d)/) || [])[1] || 1));
  if (values.length !== count || values.some(v => typeof v !== "number"))
    throw new Error(`${where}: expected ${count} number(s), got ${JSON.stringify(value)}`);
  const [low, high, integer] = UNIFORM_RANGES[b.array];
  for (const v of values)
    if (!Number.isFinite(v) || v < low || v > high || (integer && !Number.isInteger(v)))
      throw new Error(`${where}: ${v} is not ` +
                      `${integer ? `an integer in ${low}..${high}` : "a finite f32"}`);
  return values;
}

function uniformBuffer(device, kernel, b, value) {
  const Array_ = {Float32Array, Uint32Array, Int32Array}[b.array];
  if (!Array_)
    throw new Error(`kernel ${kernel.name} binding '${b.name}': pass a GPUBuffer for ${b.elem}`);
  const data = new Array_(4);
  data.set(uniformValues(kernel, b, value));
  const buf = device.createBuffer({size: 16, usage: GPUBufferUsage.UNIFORM,
                                   mappedAtCreation: true});
  new Array_(buf.getMappedRange()).set(data);
  buf.unmap();
  return buf;
}

function resourcesOf(device, kernel, buffers) {
  const names = kernel.bindings.map(b => b.name);
  const unknown = Object.keys(buffers).filter(n => !names.includes(n));
  if (unknown.length)
    throw new Error(`kernel ${kernel.name} has no binding(s) ${unknown}; it takes ${names}`);
  return kernel.bindings.map(b => {
    let buf = buffers[b.name];
    const where = `kernel ${kernel.name} binding '${b.name}' (@binding(${b.binding}))`;
    if (buf === undefined) throw new Error(`${where}: no buffer given; it takes ${names}`);
    if (!(buf instanceof GPUBuffer)) {
      if (b.access !== "uniform") throw new Error(`${where}: expected a GPUBuffer`);
      buf = uniformBuffer(device, kernel, b, buf);
    }
    const need = b.access === "uniform" ? GPUBufferUsage.UNIFORM : GPUBufferUsage.STORAGE;
    const usage = b.access === "uniform" ? "UNIFORM" : "STORAGE";
    if (!(buf.usage & need)) throw new Error(`${where}: the buffer lacks GPUBufferUsage.${usage}`);
    if (buf.size < b.minBytes)
      throw new Error(`${where}: buffer has ${buf.size} bytes, needs at least ${b.minBytes} ` +
                      `(${b.length ?? 1} x ${b.elem})`);
    return buf;
  });
}

function bindGroupOf(device, kernel, s, list) {
  let entries = s.groups.get(list[0]);
  if (!entries) s.groups.set(list[0], entries = []);
  let hit = entries.find(e => e.list.every((buf, i) => buf === list[i]));
  if (!hit) {
    hit = {list, group: device.createBindGroup({layout: s.bindGroupLayout, entries:
      kernel.bindings.map((b, i) => ({binding: b.binding, resource: {buffer: list[i]}}))})};
    entries.push(hit);
  }
  return hit.group;
}

function grid3(kernel, grid) {
  const g = typeof grid === "number" ? [grid, 1, 1] : [...grid, 1, 1, 1].slice(0, 3);
  if (!g.every(n => Number.isInteger(n) && n >= 1))
    throw new Error(`kernel ${kernel.name}: workgroup counts must be integers >= 1, got ${grid}`);
  return g;
}

/** Record one dispatch of ``kernel`` into an open compute pass. */
export function encodeKernel(pass, device, kernel, buffers, grid, constants = {}) {
  const s = stateOf(device, kernel);
  const [x, y, z] = grid3(kernel, grid);
  const group = bindGroupOf(device, kernel, s, resourcesOf(device, kernel, buffers));
  pass.setPipeline(pipelineOf(device, kernel, s, constants));
  pass.setBindGroup(0, group);
  pass.dispatchWorkgroups(x, y, z);
}

/** One dispatch in its own pass; submitted at once unless an ``encoder`` is given. */
export function dispatchKernel(device, kernel, buffers, grid,
                               {constants = {}, encoder = null} = {}) {
  const enc = encoder || checkedDevice(device, kernel).createCommandEncoder({label: kernel.name});
  const pass = enc.beginComputePass({label: kernel.name});
  encodeKernel(pass, device, kernel, buffers, grid, constants);
  pass.end();
  if (!encoder) device.queue.submit([enc.finish()]);
}

/** Workgroups along x covering ``n`` invocations. */
export function workgroupsFor(kernel, n) {
  return Math.ceil(n / kernel.workgroupSize[0]);
}
"""

SINGLE_JS = """/** Run the kernel: ``buffers`` by binding name (GPUBuffers; uniforms may take
 *  numbers), ``grid`` workgroups (a number or [x, y, z]). Submits unless given an ``encoder``. */
export function dispatch(device, buffers, grid, options = {}) {
  dispatchKernel(device, kernel, buffers, grid, options);
}

/** Compile the pipeline now, so the first dispatch does not wait; rejects on WGSL errors. */
export function prepare(device, constants = {}) {
  return prepareKernel(device, kernel, constants);
}
"""

RUNTIME_DTS = """export interface BindingInfo {
  binding: number; name: string; access: "read" | "read_write" | "uniform";
  type: GPUBufferBindingType; elem: string; dtype: string | null; array: string | null;
  elemBytes: number; length: number | null; minBytes: number; shape: (number | string)[] | null;
}
export interface OverrideInfo { name: string; type: string; default: number | boolean | null; }
export interface KernelInfo {
  name: string; entryPoint: string; workgroupSize: [number, number, number];
  features: GPUFeatureName[]; overrides: OverrideInfo[]; workgroupBytes: number;
  bindings: BindingInfo[]; wgsl: string;
}
export type Grid = number | [number] | [number, number] | [number, number, number];
export declare function prepareKernel(device: GPUDevice, kernel: KernelInfo,
  constants?: Record<string, number>): Promise<GPUComputePipeline>;
export declare function encodeKernel(pass: GPUComputePassEncoder, device: GPUDevice,
  kernel: KernelInfo, buffers: Record<string, GPUBuffer | number | ArrayLike<number>>, grid: Grid,
  constants?: Record<string, number>): void;
export declare function dispatchKernel(device: GPUDevice, kernel: KernelInfo,
  buffers: Record<string, GPUBuffer | number | ArrayLike<number>>, grid: Grid,
  options?: {constants?: Record<string, number>; encoder?: GPUCommandEncoder}): void;
export declare function workgroupsFor(kernel: KernelInfo, n: number): number;
"""

SINGLE_DTS = """export interface DispatchOptions {
  constants?: Constants; encoder?: GPUCommandEncoder;
}
export declare function dispatch(device: GPUDevice, buffers: Buffers, grid: Grid,
  options?: DispatchOptions): void;
export declare function prepare(device: GPUDevice,
  constants?: Constants): Promise<GPUComputePipeline>;
"""
