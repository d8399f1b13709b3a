"""Language models with LoRA on the GPU: transformers' LlamaForCausalLM and
Qwen2ForCausalLM, their config (:mod:`lora.models.config`), rotary tables
(:mod:`lora.models.rope`), weights from a local Hugging Face folder or a
transformers / peft model (:mod:`lora.models.weights`), peft's
``target_modules`` (:mod:`lora.models.targets`), trained and run with the
kernels of :mod:`lora.kernels` and the optimizers of :mod:`lora.training`."""
