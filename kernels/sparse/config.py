"""Per-layer, per-head sparse attention patterns, loaded from JSON with a sensible default.

Two JSON shapes are accepted:

* tgserve's own::

    {"block": 64, "last_q": 64, "min_seq_len": 32768, "range_max_len": 524288,
     "mean_keys_max_len": 524288, "tail_min_len": 65536, "tail_max_len": 524288,
     "default": {"kind": "vertical_slash", "vertical": 1000, "slash": 6096},
     "layers": {"0": {"3": {"kind": "a_shape", "sink": 128, "local": 2048}}}}

  Heads (query heads) not listed use the layer's "default" entry if any, else the global default.

* MInference's offline search output (`*_best_pattern.json`): a list with one object per layer,
  mapping a head index to [pattern, vertical_size, slash_size, score], pattern being
  "vertical_and_slash", "stream_llm" (A-shape: sizes are sink, local) or "block_sparse".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

KINDS = ("dense", "a_shape", "vertical_slash", "block_sparse")
RESCUE_AGAINST = ("keys", "range-boxes", "boxes")


@dataclass(frozen=True)
class HeadPattern:
    """What one query head keeps of the causal attention matrix.

    dense           everything.
    a_shape         the first `sink` keys and a local window of `local` keys (block granular).
    vertical_slash  `vertical` key columns and `slash` diagonals, the top ones by the attention of
                    the last queries; the first `sink` columns and the `local` nearest diagonals
                    are always kept (they are never worth risking).
    block_sparse    `blocks` key blocks per query block, top ones by pooled (block-mean) scores.
    rescue          (estimated kinds) extra key blocks per query block, chosen by the block-mean
                    query against every key, for keys salient only to queries far from the end
                    of the prompt, which last-query estimation cannot see.
    rescue_range    of the rescue blocks, how many (at most all of them) are chosen by the query
                    block's range bound (the largest logit any of its queries can give a key: per
                    coordinate its largest or smallest query value) after the others by its mean
                    query: a key that only a few of the block's queries seek keeps its whole
                    logit there. The default, three with one by the range, is the split that
                    kept every needle on five of six structured families without losing the far
                    diagonals' mass that the mean-chosen blocks hold
                    (docs/benchmarks/2026-12-05-rescue-splits-cpu.md).
    rescue_against  what the rescue scores a query block against: "keys", every key, max-pooled
                    per key block ([Q, n] products); "boxes", each key block's box, its keys'
                    per-coordinate largest and smallest values ([Q, Q] products, `boxes.py`);
                    "range-boxes" (the default), keys for the blocks by the mean and boxes for
                    those by the range: the mean's picks hold far diagonals' mass better against
                    keys, the range's find needles as well or better against boxes, and the
                    range's pass costs half as much (H100: 2.7 against 5.3 ms a layer at 128K,
                    14 against 54 at 512K; docs/benchmarks/2026-12-06-rescue-by-boxes-triton-h100.md).
    tail            also attend to the key blocks the pattern skips, each summarised by its mean
                    key and value, as one extra key per query block (`tail.py`): the attention
                    spread thinly over a long prompt, which no block choice holds. True or False
                    for every length; None (the default) leaves it to the config's
                    `tail_min_len` .. `tail_max_len` (`SparseConfig.head_patterns`).
    """

    kind: str = "vertical_slash"
    vertical: int = 1000
    slash: int = 6096
    sink: int = 64
    local: int = 128
    blocks: int = 100
    rescue: int = 3
    rescue_range: int = 1
    rescue_against: str = "range-boxes"
    tail: bool | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown sparse pattern {self.kind!r}; expected one of {KINDS}")
        if self.rescue_against not in RESCUE_AGAINST:
            raise ValueError(
                f"unknown rescue_against {self.rescue_against!r}; expected one of {RESCUE_AGAINST}"
            )
        if (
            min(self.vertical, self.slash, self.sink, self.local, self.blocks, self.rescue, self.rescue_range)
            < 0
        ):
            raise ValueError(f"negative budget in {self}")
        # {"rescue": 0} means no rescue at all, whatever the default's share by the range.
        object.__setattr__(self, "rescue_range", min(self.rescue_range, self.rescue))

    def without_range(self) -> HeadPattern:
        """The pattern less its blocks by the range (the mean-chosen ones kept)."""
        return replace(self, rescue=self.rescue - self.rescue_range, rescue_range=0)

    def mean_against_boxes(self) -> HeadPattern:
        """A "range-boxes" pattern with the mean's blocks against boxes too ("keys" stays as is)."""
        return replace(self, rescue_against="boxes") if self.rescue_against == "range-boxes" else self


DEFAULT_PATTERN = HeadPattern()


@dataclass(frozen=True)
class SparseConfig:
    """Sparse prefill settings of a model: per-layer head patterns and shared parameters."""

    default: HeadPattern = DEFAULT_PATTERN
    layers: dict[int, dict[int, HeadPattern]] = field(default_factory=dict)
    # Prompts shorter than this use dense attention, chunked. In the engine (Llama-3-8B's shape,
    # H100) a whole-prompt sparse step ties chunked dense at 32K and is 2.2-2.6x faster from 48K,
    # though against one cuDNN call sparse is 0.9x at 32K (benchmarks/sparse_threshold_cuda.py).
    min_seq_len: int = 32768
    block: int = 64  # query/key block of the sparse kernel and of pooled estimation
    last_q: int = 64  # queries used to estimate vertical-slash indices
    # Longer prompts drop their rescue blocks by the range. Against keys that pass cost 2.0-2.2x
    # the mean one (H100, e4m3), ~7 s of a 1M-token prompt's ~35 s first token on an H200;
    # against boxes (the default) 40 ms a layer at 1M on an H100, still ~1.3 s, for needles that
    # no target asks for past 512K.
    range_max_len: int = 524288
    # Longer prompts score the mean's rescue blocks of "range-boxes" patterns against boxes too.
    # H100, a layer: 33 against 125 ms at 1M (~2.9 s of the first token), 14 against 38 at 512K.
    # At 1M on structured prompts rel L2 rose 0.2-0.4% (rope, diffuse) and 7% (far-slashes),
    # needles kept alike; at 8K on SmolLM2 (a 128K share of the budget, where the rescue weighs
    # more) 7-27% a layer, which is why shorter prompts keep keys
    # (docs/benchmarks/2026-12-06-rescue-by-boxes-triton-h100.md).
    mean_keys_max_len: int = 524288
    # Prompts in this range fold in the tail of skipped blocks where a pattern leaves it unset. An
    # H100's cost a layer (32 query / 8 KV heads): 1.0 ms at 32K, 1.2 at 64K, 2.0 at 128K (4% of
    # sparse's 49 ms), 18.9 at 512K, 62 at 1M; at 32K sparse only ties cuDNN (12.8 ms), so the
    # tail would make it slower than dense there, and at 1M it would add 2 s to a ~35 s first
    # token. From 64K it lowered relative L2 on five of six structured families and changed
    # none for the worse (docs/benchmarks/2026-12-06-sparse-tail-default-h100.md).
    tail_min_len: int = 65536
    tail_max_len: int = 524288

    def head_patterns(self, layer: int, num_heads: int, seq_len: int | None = None) -> list[HeadPattern]:
        """The pattern of every query head of one layer, as written, or for a prompt of seq_len
        tokens: past range_max_len without the rescue block by the range, past mean_keys_max_len
        with the mean's blocks against boxes, the tail resolved by the length where the pattern
        leaves it unset."""
        per_head = self.layers.get(layer, {})
        patterns = [per_head.get(h, per_head.get(-1, self.default)) for h in range(num_heads)]
        if seq_len is None:  # as written (an unset tail is off)
            return patterns
        if seq_len > self.range_max_len:
            patterns = [p.without_range() if p.rescue_range else p for p in patterns]
        if seq_len > self.mean_keys_max_len:
            patterns = [p.mean_against_boxes() for p in patterns]
        tail = self.tail_min_len <= seq_len <= self.tail_max_len
        return [p if p.tail is not None else replace(p, tail=tail) for p in patterns]


SHARED_FIELDS = (
    "min_seq_len",
    "block",
    "last_q",
    "range_max_len",
    "mean_keys_max_len",
    "tail_min_len",
    "tail_max_len",
)


def _pattern(entry: dict[str, Any], base: HeadPattern) -> HeadPattern:
    unknown = set(entry) - set(HeadPattern.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown sparse pattern fields {sorted(unknown)}")
    return replace(base, **entry)


def _from_minference(layers: list[dict[str, list[Any]]]) -> SparseConfig:
    """MInference's [pattern, vertical_size, slash_size, score] per head."""
    parsed: dict[int, dict[int, HeadPattern]] = {}
    for layer, heads in enumerate(layers):
        parsed[layer] = {}
        for head, (name, first, second, *_score) in heads.items():
            if name == "vertical_and_slash":
                pattern = HeadPattern("vertical_slash", vertical=int(first), slash=int(second))
            elif name == "stream_llm":
                pattern = HeadPattern("a_shape", sink=int(first), local=int(second))
            elif name == "block_sparse":
                pattern = HeadPattern("block_sparse", blocks=int(first) or DEFAULT_PATTERN.blocks)
            else:
                raise ValueError(f"unknown MInference pattern {name!r}")
            parsed[layer][int(head)] = pattern
    return SparseConfig(layers=parsed)


def parse_sparse_config(data: dict[str, Any] | list[Any]) -> SparseConfig:
    """Build a SparseConfig from decoded JSON (either accepted shape)."""
    if isinstance(data, list):
        return _from_minference(data)
    default = _pattern(data.get("default", {}), DEFAULT_PATTERN)
    layers: dict[int, dict[int, HeadPattern]] = {}
    for layer, heads in data.get("layers", {}).items():
        layer_default = _pattern(heads.get("default", {}), default)
        layers[int(layer)] = {-1: layer_default} | {
            int(h): _pattern(entry, layer_default) for h, entry in heads.items() if h != "default"
        }
    shared = {k: int(data[k]) for k in SHARED_FIELDS if k in data}
    return SparseConfig(default=default, layers=layers, **shared)


def load_sparse_config(path: str | Path | None) -> SparseConfig:
    """Read a pattern file; None gives the default (vertical-slash 1000/6096 on every head)."""
    if path is None:
        return SparseConfig()
    return parse_sparse_config(json.loads(Path(path).read_text()))
