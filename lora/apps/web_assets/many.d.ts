/** lora.core.many_plan.chosen_form's constants and the form it names in each case. */
export interface FormRule { segmentRows: number; fusedRows: number; fusedRank: number;
  decode: string; prefill: string; highRank: string; }
export declare const config: {inDim: number; outDim: number; dtype: "f32" | "f16";
  maxRank: number; rankStride: number; rule: FormRule; features: GPUFeatureName[]};
/** One dispatch of a form: its kernel, the grid at one item, the axis of the items. */
export interface ManyStep { kernel: number; grid: [number, number, number]; items: 0 | 1 | 2;
  buffers: Record<string, string>; }
/** A form the module ships: ManyPlan's options as shipped, and what was cut to fit. */
export interface ManyForm { segments: boolean; fused: boolean; tileTokens: number;
  options: Record<string, number | boolean>; fitted: string | null; steps: ManyStep[]; }
export declare const forms: Record<string, ManyForm>;
export declare function chooseForm(rows: number, used: number, rank: number): string;
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
    order?: GPUBuffer; tiles?: GPUBuffer; ids?: GPUBuffer; h?: GPUBuffer};
  readonly slots: number[];
  readonly size: number;
  rank(slot: number): number;
  scale(slot: number): number;
  add(layer: AdapterLayer, name?: string): number;
  remove(slot: number): void;
  formFor(ids: ArrayLike<number>): string;
  record(buffers: {x: GPUBuffer; output: GPUBuffer}, ids: ArrayLike<number>,
    options?: {encoder?: GPUCommandEncoder | null; form?: string | null}): string | null;
  forward(x: ArrayLike<number>, ids: ArrayLike<number>,
    base?: ArrayLike<number> | null, options?: {form?: string | null}): Promise<Float32Array>;
  destroy(): void;
}
export declare function createPool(device: GPUDevice, options?: PoolOptions): AdapterPool;
