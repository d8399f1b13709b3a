export interface Layer { a: Float32Array; b: Float32Array; rank: number;
  inDim: number; outDim: number; alpha: number; scale: number; }
export declare const config: { tokens: number; alpha: number; scale: number;
  optimizer: "adamw" | "sgd"; lr: number; given: string[];
  loss: { kind: "mse" | "xent"; buffer: string; count: number; classes: number };
  adapters: Record<string, { a: string; b: string; rank: number; inDim: number;
    outDim: number; alpha: number; scale: number }>; features: string[] };
export interface LoraTrainer {
  readonly config: typeof config;
  readonly steps: number;
  step(inputs: Record<string, Float32Array | Uint32Array | GPUBuffer>): void;
  loss(): Promise<number>;
  adapters(): Promise<Record<string, Layer>>;
  adapter(): Promise<Layer>;
  destroy(): void;
}
export function loraTrainer(device: GPUDevice,
  weights?: Record<string, { a?: Float32Array; b?: Float32Array }>): Promise<LoraTrainer>;
