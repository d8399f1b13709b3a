"""The causal language model (issue 42): transformers' LlamaForCausalLM and
Qwen2ForCausalLM with LoRA adapters, on the GPU. Here so far the host side of loading
one: its config (:mod:`lora.models.config`), rotary tables (:mod:`lora.models.rope`),
weights from a local Hugging Face folder or a transformers / peft model
(:mod:`lora.models.weights`) and peft's ``target_modules`` (:mod:`lora.models.targets`)."""
