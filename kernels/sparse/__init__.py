"""MInference-style sparse prefill: per-head patterns, online index estimation, sparse kernel.

config     HeadPattern / SparseConfig, JSON loading (tgserve's shape or MInference's) and defaults
estimate   torch estimation (twins of lastq and pooled): last-query vertical-slash statistics,
           pooled block scores, rescue blocks, top-k selection
lastq      Triton last-query statistics: vertical and block-diagonal scores, all heads at once
pooled     Triton rescue blocks: block-mean query x every key, max-pooled, top-k fused
index      SparseIndex: block diagonals + listed blocks + columns, and its exact element mask
kernel     Triton sparse attention over a SparseIndex
attention  estimate + attend for one prompt, with a torch twin of the whole path
"""

from tgserve.kernels.sparse.config import HeadPattern, SparseConfig, load_sparse_config, parse_sparse_config

__all__ = ["HeadPattern", "SparseConfig", "load_sparse_config", "parse_sparse_config"]
