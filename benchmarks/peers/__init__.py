"""Colibri against other engines: llama.cpp (its tools, GGUF files) and transformers on
PyTorch CPU; the per-engine runners each run in their own process."""
