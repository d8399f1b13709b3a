"""What runs on top of the library: the command line, benchmarks, the web
export and the digits fine-tuning example. Nothing in lora imports these."""
