"""MInference-style sparse prefill: per-head patterns, online index estimation, sparse kernel.

config     HeadPattern / SparseConfig, JSON loading (tgserve's shape or MInference's) and defaults
estimate   torch estimation (twins of lastq and pooled): last-query vertical-slash statistics,
           pooled block scores, rescue blocks, top-k selection
lastq      Triton last-query statistics: vertical and block-diagonal scores, all heads at once
pooled     Triton rescue blocks: block-mean query x every key, max-pooled, top-k fused
boxes      rescue blocks against key-block boxes (largest / smallest key value a coordinate), torch twin
boxes_kernel  Triton rescue against boxes: per-head boxes less columns, bounds streamed into a top-k
index      SparseIndex: block diagonals + listed blocks + columns, and its exact element mask
kernel     Triton sparse attention over a SparseIndex
tail       the blocks a pattern skips, summarised as one extra key per query block (64K-512K; twin)
tail_kernel  Triton tail: the same summaries streamed, nothing quadratic held
attention  estimate + attend for one prompt, with a torch twin of the whole path

Measurement: synthetic (planted and structured prompts), accuracy (sampled scoring, block
oracle), minference_baseline (MInference's vertical-slash index), shifted_bands (token-shift
band model), search (per-model pattern search).
"""

from tgserve.kernels.sparse.config import HeadPattern, SparseConfig, load_sparse_config, parse_sparse_config

__all__ = ["HeadPattern", "SparseConfig", "load_sparse_config", "parse_sparse_config"]
