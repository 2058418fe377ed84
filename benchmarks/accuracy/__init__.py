"""What precision costs: per tensor class precision, KV cache storage types, adaptive k,
the converter's families, the core figures."""
