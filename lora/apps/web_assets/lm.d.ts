/** A weights file that does not hold this module's model. */
export declare class ModelError extends Error {}
/** Token ids: one sequence (a flat array), or rows of one length. */
export type TokenRows = ArrayLike<number> | ArrayLike<number>[];
/** An adapter's layer: row-major A [rank, inDim] and B [outDim, rank]. */
export interface LmLayer { a: Float32Array; b: Float32Array; rank: number; inDim: number;
  outDim: number; alpha: number; scale: number; }
export interface GivenLayer { a: Float32Array; b: Float32Array; rank?: number; inDim?: number;
  outDim?: number; scale?: number; alpha?: number; }
export type WeightsSource = string | URL | Response | Blob | ArrayBuffer | ArrayBufferView;
export interface LmSettings { lr: number; weightDecay: number; maxGradNorm: number | null;
  warmup: number; total: number; minRatio: number; beta1?: number; beta2?: number;
  eps?: number; momentum?: number; }
export interface LmAdapterInfo { a: string; b: string; masterA: string; masterB: string;
  rank: number; inDim: number; outDim: number; alpha: number; useRslora: boolean;
  scale: number; }
export declare const config: {
  model: { architecture: string; modelType: string; vocabSize: number; hiddenSize: number;
    intermediateSize: number; layers: number; heads: number; kvHeads: number; headDim: number;
    maxPositions: number; tied: boolean; eosTokenIds: number[]; padTokenId: number | null;
    bosTokenId: number | null; folder: string };
  dtype: "f32" | "f16";
  shapes: { batch: number; seq: number; genBatch: number; prompt: number; newTokens: number };
  tensors: Record<string, number[]>;
  weights: { buffer: string; tensor: string; first: number; rows: number; dtype: string }[];
  adapters: Record<string, LmAdapterInfo>;
  targetModules: string[]; loraDropout: number; seed: number;
  optimizer: { kind: "adamw" | "sgd"; schedule: "constant" | "linear" | "cosine";
    values: LmSettings; buffer: string; index: Record<string, number>;
    limits: Record<string, [number, number | null, boolean]> };
  io: Record<string, Record<string, string>>;
  stepsPerSubmit: number;
  limits: { maxStorageBufferBindingSize: number; maxBufferSize: number };
  memory: { model: number; train: number; logits: number; generate: number; shared: number };
  features: GPUFeatureName[];
};
export interface LmStep { kernel: number; grid: [number, number, number];
  buffers: Record<string, string>; uniforms?: Record<string, [number, number]>; }
export declare const buffers: Record<string, { bytes: number; dtype: string; group: string;
  init: string | null }>;
export declare const graphs: Record<string, (LmStep | { copy: [string, string, number] })[]>;
export declare const kernels: KernelInfo[];
export interface GenerateOptions { maxNewTokens: number; eosTokenId?: number | number[] | null;
  attentionMask?: TokenRows | null; padTokenId?: number | null;
  onToken?: (token: { step: number; ids: number[] }) => void; stepsPerSubmit?: number; }
export interface CausalLM {
  readonly config: typeof config;
  readonly steps: number;
  readonly settings: LmSettings & { schedule: string };
  readonly peftOptions: { targetModules: string[]; useRslora: boolean; taskType: "CAUSAL_LM";
    loraDropout: number };
  set(changes: Partial<LmSettings>): void;
  logits(inputIds: TokenRows, options?: { attentionMask?: TokenRows | null }):
    Promise<Float32Array>;
  generate(inputIds: TokenRows, options: GenerateOptions): Promise<number[][]>;
  step(inputIds: TokenRows, options?: { labels?: TokenRows | null;
    attentionMask?: TokenRows | null }): Promise<void>;
  loss(): Promise<number>;
  losses(): Promise<number[]>;
  adapters(): Promise<Record<string, LmLayer>>;
  loadAdapter(layers: Record<string, GivenLayer>): void;
  keptAdapter(): Promise<{ steps: number; layers: Record<string, LmLayer> }>;
  memory(): { weights: number; adapters: number; train: number; logits: number;
    generate: number; shared: number };
  destroy(): void;
}
export declare function loadCausalLM(device: GPUDevice,
  weights: WeightsSource | WeightsSource[],
  options?: { adapter?: Record<string, GivenLayer> | null; seed?: number;
    keepAdapter?: boolean;
    onProgress?: (progress: { loaded: number; total: number; tensor: string }) => void }):
  Promise<CausalLM>;
export declare function configDifferences(text: string): string[];
