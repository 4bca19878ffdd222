"""MInference-style sparse prefill: per-head patterns, online index estimation, sparse kernel.

config     HeadPattern / SparseConfig, JSON loading (tgserve's shape or MInference's) and defaults
estimate   last-query vertical-slash statistics, pooled block scores, top-k selection (torch)
pooled     Triton block-mean-query x max-pooled-key scores (rescue estimation)
index      SparseIndex: block diagonals + listed blocks + columns, and its exact element mask
kernel     Triton sparse attention over a SparseIndex
attention  estimate + attend for one prompt, with a torch twin of the whole path
"""

from tgserve.kernels.sparse.config import HeadPattern, SparseConfig, load_sparse_config, parse_sparse_config

__all__ = ["HeadPattern", "SparseConfig", "load_sparse_config", "parse_sparse_config"]
