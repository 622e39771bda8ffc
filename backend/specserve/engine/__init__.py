"""The engine: continuous batching, one draft-and-verify step at a time, sampling, adaptive draft sizes, its thread."""
