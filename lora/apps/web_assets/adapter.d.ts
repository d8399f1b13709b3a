// lora_adapter.d.ts: peft adapter files in the page (lora_adapter.js).
export class AdapterFileError extends Error {}
export interface Tensor { dtype: "F32" | "F16"; shape: number[]; data: Float32Array | Uint16Array; }
export interface Layer { a: Float32Array; b: Float32Array; rank: number; inDim: number;
  outDim: number; alpha?: number; scale?: number; }
/** A layer as readPeftAdapter returns it: alpha and scale always there. */
export interface ReadLayer extends Layer { alpha: number; scale: number; }
export function readSafetensors(bytes: ArrayBuffer | Uint8Array, name?: string):
  { metadata: Record<string, string>; tensors: Record<string, Tensor> };
export function writeSafetensors(tensors: Record<string, Tensor>,
  metadata?: Record<string, string>): Uint8Array;
export function halfToFloat(bits: number): number;
export function readPeftAdapter(configText: string, tensorBytes: ArrayBuffer | Uint8Array,
  names?: { config?: string; tensors?: string }):
  { config: Record<string, unknown>; layers: Record<string, ReadLayer>; ignored: string[] };
export function writePeftAdapter(layers: Record<string, Layer>,
  options?: { alpha?: number | Record<string, number>; targetModules?: string[] | string;
              useRslora?: boolean; taskType?: string | null; loraDropout?: number;
              baseModelNameOrPath?: string | null }):
  { config: string; tensors: Uint8Array };
