"""Colibri's benchmarks, run from the repository root as modules:

    python -m benchmarks.<group>.<name> [options]

speed/       how fast: kernels, decode, prefill, the pipeline, the scheduler, serving, the
             memory budget, hot-plug, the fleet, models of published shapes at full size
peers/       against other engines: llama.cpp (its tools, GGUF files) and transformers
accuracy/    what precision costs: quantization, KV cache storage types, adaptive k, the
             converter's families, the core figures
robustness/  attacks on the server, fuzzing, soak, leaks, the cgroups a run is held in
common.py    shared by all: the benchmark model, RSS, percentiles, read bandwidth, the
             commit and machine a figure was measured on

Results go to benchmarks/out/ (not tracked). docs/BENCHMARKS.md says what each measures.
"""
