/** Compile every kernel's pipeline (once per device); rejects on WGSL errors. */
export declare function prepare(device: GPUDevice): Promise<GPUComputePipeline[]>;
/** The float16 bits nearest ``value`` (ties to even), as numpy's astype(float16). */
export declare function halfBits(value: number): number;
