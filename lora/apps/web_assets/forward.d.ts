export declare const config: {rank: number; inDim: number; outDim: number;
  tokens: number; scale: number; dtype: "f32" | "f16"; strategy: string;
  features: GPUFeatureName[]};
export declare const sizes: {x: number; a: number; b: number; output: number; h: number; y: number};
export declare const steps: {kernel: number; grid: [number, number, number];
  buffers: Record<string, string>}[];
export declare const kernels: KernelInfo[];
export declare function prepare(device: GPUDevice): Promise<GPUComputePipeline[]>;
export declare function loraForward(device: GPUDevice,
  buffers: {x: GPUBuffer; a: GPUBuffer; b: GPUBuffer; output: GPUBuffer},
  options?: {encoder?: GPUCommandEncoder}): Promise<void>;
