"""BucketConfig: how steps are padded to static shapes (tgi-gaudi's knobs); the schemes and the
shapes built from it are in `tgserve.server.static_shapes.buckets`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BucketConfig:
    """How steps are padded on static-shape devices; tgi-gaudi's environment names in comments
    (the CLI reads them)."""

    scheme: str = "linear"  # or "exponential"
    batch_step: int = 8  # BATCH_BUCKET_SIZE: decode batch sizes
    prefill_batch_step: int = 4  # PREFILL_BATCH_BUCKET_SIZE: sequences in a prefill step
    token_step: int = 128  # PAD_SEQUENCE_TO_MULTIPLE_OF: tokens in a prefill step
    warmup: bool = True  # WARMUP_ENABLED: compile every shape before serving
    graphs: bool = True  # ENABLE_HPU_GRAPH: replay captured graphs (HPU graphs, CUDA graphs)
    decode_graphs_only: bool = False  # LIMIT_HPU_GRAPH: graphs for decode steps only (saves memory)

    def __post_init__(self) -> None:
        if self.scheme not in ("linear", "exponential"):
            raise ValueError(f"bucketing scheme must be 'linear' or 'exponential', got {self.scheme!r}")
