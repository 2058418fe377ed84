"""A model opened for inference: its weights (weights), the math in numpy (ops), routing,
DeepSeek's latent attention (mla), the KV cache and its pool (seqcache, kvcache), the
fingerprint a hot-plugged expert records, and random models written straight into the
format (testing)."""
