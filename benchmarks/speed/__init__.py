"""Speed benchmarks: kernels, decode, prefill, the pipeline, the scheduler, serving, the
memory budget, hot-plug, the fleet, published MoE shapes at full size."""
