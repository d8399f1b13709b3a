"""Training a LoRA layer on the GPU: backward strategies and plans, losses,
optimizers, the one-submit training step, and adapter files (peft, Hesper)."""
