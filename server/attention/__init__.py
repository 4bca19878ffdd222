"""Attention over the engine's paged KV cache: per-step metadata and the backends that compute it."""
