"""Language models with LoRA on the GPU: transformers' Llama and Qwen2 causal
LMs, their weights read from a folder or a model in memory, trained and run
with the kernels of :mod:`lora.kernels` and the optimizers of :mod:`lora.training`."""
