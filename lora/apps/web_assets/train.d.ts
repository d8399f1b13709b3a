export interface Layer { a: Float32Array; b: Float32Array; rank: number;
  inDim: number; outDim: number; alpha: number; scale: number; }
/** The optimizer's settings, as exported (lora export --lr, --weight-decay, ...) and as
 *  changed by set(). AdamW has beta1, beta2 and eps; SGD has momentum. */
export interface OptimizerSettings { lr: number; weightDecay: number; maxGradNorm: number | null;
  warmup: number; total: number; minRatio: number; beta1?: number; beta2?: number;
  eps?: number; momentum?: number; }
export type Schedule = "constant" | "linear" | "cosine";
export declare const config: { tokens: number; alpha: number; scale: number; seed: number;
  optimizer: { kind: "adamw" | "sgd"; schedule: Schedule; values: OptimizerSettings;
    buffer: string; index: Record<string, number>;
    limits: Record<string, [number, number | null, boolean]> };
  given: string[];
  loss: { kind: "mse" | "xent"; buffer: string; count: number; classes: number;
    seen?: string | null };
  adapters: Record<string, { a: string; b: string; rank: number; inDim: number;
    outDim: number; alpha: number; scale: number }>; features: GPUFeatureName[] };
export declare const buffers: Record<string, { bytes: number; dtype: string; init: string | null }>;
export declare const steps: ({ kernel: number; grid: [number, number, number];
  buffers: Record<string, string> } | { copy: [string, string, number] })[];
export declare const kernels: KernelInfo[];
export declare function bytesOfBase64(text: string): Uint8Array;
export interface LoraTrainer {
  readonly config: typeof config;
  readonly steps: number;
  readonly settings: OptimizerSettings & { schedule: Schedule };
  set(changes: Partial<OptimizerSettings>): void;
  step(inputs: Record<string, Float32Array | Uint32Array | GPUBuffer>): void;
  loss(): Promise<number>;
  losses(): Promise<number[]>;
  adapters(): Promise<Record<string, Layer>>;
  adapter(): Promise<Layer>;
  destroy(): void;
}
export declare function loraTrainer(device: GPUDevice,
  weights?: Record<string, { a: Float32Array; b: Float32Array; rank?: number; inDim?: number;
    outDim?: number; scale?: number }>): Promise<LoraTrainer>;
