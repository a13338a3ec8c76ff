"""Applications over the engine and the runtime: profiling, evaluation and its suite, simulation, the demo, KV quantization."""
