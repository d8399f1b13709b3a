export declare const config: {rank: number; inDim: number; outDim: number;
  tokens: number; scale: number; dtype: "f32" | "f16"; strategy: string;
  features: GPUFeatureName[]};
export declare const sizes: {x: number; a: number; b: number; output: number; h: number; y: number};
export declare const steps: {kernel: number; grid: [number, number, number];
  buffers: Record<string, string>}[];
export declare const kernels: KernelInfo[];
/** An adapter layer as lora_adapter.js's readPeftAdapter returns it. */
export interface AdapterLayer { a: Float32Array; b: Float32Array; rank: number; inDim: number;
  outDim: number; scale: number; }
/** A GPUBuffer, or values (Float32Array; for an f16 module also Uint16Array float16 bits). */
export type Input = GPUBuffer | Float32Array | Uint16Array;
export type ForwardInputs = {x: Input; output: Input} &
  ({a: Input; b: Input; adapter?: undefined} | {adapter: AdapterLayer; a?: undefined; b?: undefined});
export declare function checkAdapter(layer: AdapterLayer, what?: string): void;
/** output a GPUBuffer: resolves once the work is queued (or recorded into ``encoder``). */
export declare function loraForward(device: GPUDevice, inputs: ForwardInputs & {output: GPUBuffer},
  options?: {encoder?: GPUCommandEncoder}): Promise<undefined>;
/** output an array: resolves with the new output read back (a new array). */
export declare function loraForward(device: GPUDevice,
  inputs: ForwardInputs & {output: Float32Array | Uint16Array}): Promise<OutputArray>;
