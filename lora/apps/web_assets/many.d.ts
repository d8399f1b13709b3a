export declare const config: {inDim: number; outDim: number; dtype: "f32" | "f16";
  maxRank: number; tileTokens: number; form: string; features: GPUFeatureName[]};
export declare const steps: {kernel: number; grid: [number, number, number]; items: 0 | 1 | 2;
  buffers: Record<string, string>}[];
export declare const kernels: KernelInfo[];
export declare function checkIds(ids: ArrayLike<number>, slots: number[],
  bound: number): Int32Array;
export declare function segments(ids: ArrayLike<number>, tileTokens: number):
  {order: Uint32Array; tiles: Uint32Array};
/** One adapter's layer, as readPeftAdapter returns it (A [rank, inDim], B [outDim, rank]). */
export interface AdapterLayer { a: ArrayLike<number>; b: ArrayLike<number>; rank: number;
  inDim?: number; outDim?: number; scale?: number; alpha?: number; useRslora?: boolean; }
export interface PoolOptions { slots?: number; rows?: number; inDim?: number; outDim?: number;
  dtype?: "f32" | "f16"; maxRank?: number; }
export interface AdapterPool {
  readonly device: GPUDevice;
  readonly buffers: {A: GPUBuffer; B: GPUBuffer; table: GPUBuffer; tokens: GPUBuffer;
    order?: GPUBuffer; tiles?: GPUBuffer};
  readonly slots: number[];
  readonly size: number;
  rank(slot: number): number;
  scale(slot: number): number;
  add(layer: AdapterLayer, name?: string): number;
  remove(slot: number): void;
  record(buffers: {x: GPUBuffer; output: GPUBuffer}, ids: ArrayLike<number>,
    options?: {encoder?: GPUCommandEncoder}): void;
  forward(x: ArrayLike<number>, ids: ArrayLike<number>,
    base?: ArrayLike<number> | null): Promise<Float32Array>;
  destroy(): void;
}
export declare function createPool(device: GPUDevice, options?: PoolOptions): AdapterPool;
