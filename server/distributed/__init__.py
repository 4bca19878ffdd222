"""Tensor parallelism: the shard this process holds and its collectives."""
