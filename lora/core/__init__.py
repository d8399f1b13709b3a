"""The core of lora: the weight, the strategy registry, plans and their
cache, the autotuner, the numpy-facing forward and its float64 reference.
Imports go kernels -> core -> training -> hesper/apps; nothing here trains."""
