"""Requests over the model: continuous batching (scheduler), a generation (generate),
scoring (scoring), sampling, tokens <-> text, per-request k (kselect), self-speculative
decoding (speculative) and the audit log (audit)."""
