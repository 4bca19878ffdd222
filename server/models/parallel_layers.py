"""Linear, embedding and LM-head layers split across tensor-parallel shards (Megatron's scheme).

- column-parallel: each shard holds a slice of the output features (of every logical part of a
  fused projection: q, k and v each split by heads), no communication;
- row-parallel: each shard holds a slice of the input features and the partial products are summed
  across shards (the bias is added once, after the sum);
- the vocabulary (embedding rows, LM-head rows) is split into equal slices, the last one padded.

Each parameter carries a `weight_loader(param, checkpoint_tensor, part)` that copies this shard's
slice of a whole checkpoint tensor; `FusedWeightLoader` calls it. With one shard these layers
compute exactly what nn.Linear / nn.Embedding compute.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tgserve.kernels import dispatch
from tgserve.kernels.fp8_format import FP8, FP8_ALIGNMENT, quantize_rows
from tgserve.server.distributed.tensor_parallel import TensorParallel, tensor_parallel


def _attach(param: nn.Parameter, loader: Callable[[nn.Parameter, torch.Tensor, int | None], None]) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


class QuantizableLinear(nn.Module):
    """A projection whose weight `--quantize fp8` turns into fp8 rows with a scale each, or that an
    fp8 checkpoint fills with its own rows and scales (server/loading/quantization.py)."""

    weight: nn.Parameter
    weight_scale: torch.Tensor | None

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight_scale", None)

    def quantize_fp8_(self) -> None:
        """The loaded weight becomes fp8 [N, K] with float32 scales [N, 1]; `forward` then runs in fp8."""
        self._check_fp8_shape()
        weight, self.weight_scale = quantize_rows(self.weight.data)
        self.weight = nn.Parameter(weight, requires_grad=False)

    def hold_fp8_checkpoint_(self) -> None:
        """Before an fp8 checkpoint loads: the weight becomes an fp8 parameter that takes the
        checkpoint's e4m3 rows as they are, and `weight_scale` a float32 [N, 1] parameter that takes
        their scales, one per row or one per tensor (each part of a fused projection its own)."""
        self._check_fp8_shape()
        copy_rows = self.weight.weight_loader
        self.weight = nn.Parameter(torch.empty_like(self.weight, dtype=FP8), requires_grad=False)
        self.weight_scale = nn.Parameter(
            torch.ones(self.weight.shape[0], 1, dtype=torch.float32, device=self.weight.device),
            requires_grad=False,
        )

        def load_fp8(param: nn.Parameter, tensor: torch.Tensor, part: int | None) -> None:
            if tensor.dtype != FP8:
                raise ValueError(f"an fp8 checkpoint's projection weight is {tensor.dtype}, not {FP8}")
            copy_rows(param, tensor, part)

        def load_scale(param: nn.Parameter, tensor: torch.Tensor, part: int | None) -> None:
            rows = tensor.float().reshape(-1, 1)
            self._load_row_scales(
                param, rows.expand(self.full_rows(part), 1) if rows.shape[0] == 1 else rows, part
            )

        _attach(self.weight, load_fp8)
        _attach(self.weight_scale, load_scale)

    def full_rows(self, part: int | None) -> int:
        """Rows of the whole checkpoint tensor (all shards) behind `part` of this weight."""
        raise NotImplementedError

    def _load_row_scales(self, param: nn.Parameter, scales: torch.Tensor, part: int | None) -> None:
        """This shard's rows of a whole checkpoint's per-row scales [full_rows(part), 1]."""
        raise NotImplementedError

    def _check_fp8_shape(self) -> None:
        rows, cols = self.weight.shape
        if rows % FP8_ALIGNMENT or cols % FP8_ALIGNMENT:
            raise ValueError(
                f"fp8 needs projection sizes in multiples of {FP8_ALIGNMENT}; this one is {rows} x {cols}"
            )


class ColumnParallelLinear(QuantizableLinear):
    """y = x W^T + b for this shard's slice of each output part (e.g. sizes [q, k, v])."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool) -> None:
        super().__init__()
        self.tp = tensor_parallel()
        self.local_sizes = [self.tp.divide(size, "output features") for size in part_sizes]
        local_out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(local_out, in_features))
        self.bias = nn.Parameter(torch.empty(local_out)) if bias else None
        for param in (self.weight, self.bias):
            if param is not None:
                _attach(param, self._load)

    def full_rows(self, part: int | None) -> int:
        return self.local_sizes[part or 0] * self.tp.world_size

    def _load_row_scales(self, param: nn.Parameter, scales: torch.Tensor, part: int | None) -> None:
        self._load(param, scales, part)  # split by output rows, as the weight is

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, part: int | None) -> None:
        part = part or 0
        size = self.local_sizes[part]
        offset = sum(self.local_sizes[:part])
        mine = tensor.narrow(0, self.tp.rank * size, size)
        param.data[offset : offset + size].copy_(mine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.linear(x, self.weight, self.bias, self.weight_scale)


class RowParallelLinear(QuantizableLinear):
    """y = sum over shards of x_shard W_shard^T, plus b: x arrives split along its features."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.tp = tensor_parallel()
        self.local_in = self.tp.divide(in_features, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        _attach(self.weight, self._load_weight)
        if self.bias is not None:
            _attach(self.bias, lambda param, tensor, part: param.data.copy_(tensor))

    def full_rows(self, part: int | None) -> int:
        return self.weight.shape[0]

    def _load_row_scales(self, param: nn.Parameter, scales: torch.Tensor, part: int | None) -> None:
        param.data.copy_(scales)  # every shard holds every output row (its inputs are what is split)

    def _load_weight(self, param: nn.Parameter, tensor: torch.Tensor, part: int | None) -> None:
        param.data.copy_(tensor.narrow(1, self.tp.rank * self.local_in, self.local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return dispatch.linear(x, self.weight, self.bias, self.weight_scale)
        out = self.tp.all_reduce(dispatch.linear(x, self.weight, weight_scale=self.weight_scale))
        return out if self.bias is None else out + self.bias


def vocab_slice(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(first row, rows per shard): equal slices, the last one padded past the vocabulary."""
    per_shard = -(-vocab_size // tp.world_size)
    return tp.rank * per_shard, per_shard


def _load_vocab_rows(
    tp: TensorParallel, vocab_size: int
) -> Callable[[nn.Parameter, torch.Tensor, int | None], None]:
    def load(param: nn.Parameter, tensor: torch.Tensor, part: int | None) -> None:
        start, rows = vocab_slice(vocab_size, tp)
        present = max(0, min(rows, vocab_size - start))
        param.data.zero_()
        param.data[:present].copy_(tensor[start : start + present])

    return load


class VocabParallelEmbedding(nn.Module):
    """Token embeddings, each shard holding a slice of the vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = tensor_parallel()
        self.vocab_size = vocab_size
        self.start, rows = vocab_slice(vocab_size, self.tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        _attach(self.weight, _load_vocab_rows(self.tp, vocab_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside[:, None], 0.0))


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, vocab] logits from this shard's vocabulary rows, gathered from every shard."""
    tp = tensor_parallel()
    logits = hidden @ weight.t()
    if tp.world_size == 1:
        return logits
    return tp.all_gather_last_dim(logits)[:, :vocab_size]


class ParallelLMHead(nn.Module):
    """An untied LM head split by vocabulary rows like the embedding."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp = tensor_parallel()
        _, rows = vocab_slice(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        _attach(self.weight, _load_vocab_rows(tp, vocab_size))
