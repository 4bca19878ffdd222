"""gpt-oss, native: Llama's layers with biased attention projections, learned attention sinks and
windows on every other layer, and a mixture of experts of its own.

Attention is `LlamaAttention` (its q/k/v/o biases from `attention_bias`, a sink logit per head
handed to the backend as `AttentionLayerParams.sinks`); the windows come through the KV cache spec
(`layer_types`); YaRN's RoPE through `rope_inverse_frequencies`. The feed-forward block routes with
a biased linear router, the top k logits and a softmax over them (`moe_routing.route_top_logits`);
each expert projects with biases and gates with a clamped SwiGLU (`moe_routing.ClampedSwiGLU`), in
the same grouped GEMMs as the other mixtures of experts (`dispatch.fused_moe`).

Checkpoints: OpenAI's store the experts in MXFP4 (`*_blocks`: two e2m1 values a byte, the low nibble
first; `*_scales`: an e8m0 exponent per 32 values), [experts, out, in]; they are dequantized to the
model's dtype as they load (`mxfp4_dequantized`). transformers writes them unquantized as
[experts, in, out]. Either way gate and up interleave (gate the even rows of the fused projection,
up the odd), here split into the grouped GEMM's [gate; up]. Tensor parallelism splits every
expert's intermediate size, as for the other mixtures; the down projection's bias is added by the
first shard alone, so that the sum over shards counts it once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tgserve.kernels import dispatch
from tgserve.kernels.moe_routing import ClampedSwiGLU
from tgserve.server.distributed.tensor_parallel import tensor_parallel
from tgserve.server.models.llama import LlamaForCausalLM
from tgserve.server.models.moe import ExpertWeights, experts_of, in_row_slices, load_with_experts

# e2m1 values by their 4-bit code (sign in the high bit).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_EXPERTS = re.compile(
    r"^(?P<layer>.+\.mlp)\.experts\.(?P<part>gate_up_proj|down_proj)(?P<kind>|_bias|_blocks|_scales)$"
)


def mxfp4_dequantized(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., groups * 32] in `dtype` of MXFP4 blocks uint8 [..., groups, 16] and scales uint8
    [..., groups] (e8m0: 2^(scale - 127) for each 32 values)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # low nibble first
    values = torch.ldexp(table[codes], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(dtype)


# The gate's sigmoid slope and the clamp of gate and up: older transformers fix them in the model
# (1.702, 7.0) and some of its configs lack the fields; newer ones read swiglu_alpha / swiglu_limit.
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


class GptOssExperts(ExpertWeights):
    """ExpertWeights with a bias for each projection: b_gate_up [E, 2 I_shard] (gate, then up, as
    w_gate_up's rows), b_down [E, H] (zeros on every shard but the first)."""

    def __init__(self, experts: int, hidden: int, intermediate: int) -> None:
        super().__init__(experts, hidden, intermediate)
        self.b_gate_up = nn.Parameter(torch.empty(experts, 2 * self.intermediate))
        self.b_down = nn.Parameter(torch.empty(experts, hidden))

    def load_projection(self, part: str, expert: int, weight: torch.Tensor) -> None:
        """One expert's projection of the checkpoint, [out, in]: gate_up_proj (gate and up
        interleaved along the output) or down_proj."""
        if part == "gate_up_proj":
            self.load_expert(expert, "w_gate_up", 0, weight[0::2])
            self.load_expert(expert, "w_gate_up", 1, weight[1::2])
        else:
            self.load_expert(expert, "w_down", 0, weight)

    def load_bias(self, part: str, bias: torch.Tensor) -> None:
        """A projection's bias [E, out] (gate_up's interleaved as its rows are)."""
        size, start = self.intermediate, self.tp.rank * self.intermediate
        if part == "gate_up_proj":
            self.b_gate_up.data[:, :size].copy_(bias[:, 0::2].narrow(1, start, size))
            self.b_gate_up.data[:, size:].copy_(bias[:, 1::2].narrow(1, start, size))
        else:
            self.b_down.data.copy_(bias if self.tp.rank == 0 else torch.zeros_like(bias))
        self.loaded.add((f"b_{part}", 0, -1))

    def missing(self) -> list[str]:
        biases = [
            f"{name} bias"
            for name in ("gate_up_proj", "down_proj")
            if (f"b_{name}", 0, -1) not in self.loaded
        ]
        return biases + super().missing()


class GptOssMoE(nn.Module):
    """Router and experts of one layer."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        experts = int(config.num_local_experts)
        self.top_k = int(config.num_experts_per_tok)
        self.router = nn.Linear(config.hidden_size, experts, bias=True)
        self.experts = GptOssExperts(experts, config.hidden_size, config.intermediate_size)
        self.gating = ClampedSwiGLU(
            float(getattr(config, "swiglu_alpha", SWIGLU_ALPHA)),
            float(getattr(config, "swiglu_limit", SWIGLU_LIMIT)),
        )
        self.tp = tensor_parallel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return in_row_slices(self._rows, x)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        logits = dispatch.linear(x, self.router.weight, self.router.bias)  # one row: the skinny kernel
        weights, ids = dispatch.route_top_logits(logits, self.top_k)
        experts = self.experts
        out = dispatch.fused_moe(x, experts.w_gate_up, experts.w_down, weights, ids,
                                 (experts.b_gate_up, experts.b_down), self.gating)  # fmt: skip
        return self.tp.all_reduce(out)


def gpt_oss_block(config: Any, layer: int) -> nn.Module:
    return GptOssMoE(config)


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss (20B, 120B) on Llama's layers with GptOssMoE feed-forward blocks."""

    mlp_of = gpt_oss_block
    # On a Gaudi: optimum-habana (the backend there refuses learned sinks, and the twin's expert
    # loop reads the routing on the host).
    runs_on_hpu = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_with_experts(self, weights, self._placed_experts)

    def _placed_experts(
        self, weights: Iterable[tuple[str, torch.Tensor]], modules: dict[str, ExpertWeights]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Expert tensors into their stacks (MXFP4 blocks waiting for their scales, or the other
        way round); every other weight passed on."""
        dtype = self.model.norm.weight.dtype
        waiting: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            match = _EXPERTS.match(name)
            if match is None:
                yield name, tensor
                continue
            experts = experts_of(modules, match["layer"], name)
            part, kind = match["part"], match["kind"]
            if kind == "_bias":
                experts.load_bias(part, tensor.to(dtype))
            elif not kind:  # as transformers writes it: [E, in, out]
                for expert, weight in enumerate(tensor.transpose(1, 2)):
                    experts.load_projection(part, expert, weight.to(dtype))
            else:  # MXFP4, [E, out, in], once both halves came: an expert at a time (120B's are 8 GiB a layer)
                pair = waiting.setdefault(f"{match['layer']}.{part}", {})
                pair[kind] = tensor
                if len(pair) == 2:
                    del waiting[f"{match['layer']}.{part}"]
                    for expert, (blocks, scales) in enumerate(
                        zip(pair["_blocks"], pair["_scales"], strict=True)
                    ):
                        experts.load_projection(part, expert, mxfp4_dequantized(blocks, scales, dtype))
        if waiting:
            raise ValueError(
                f"checkpoint has MXFP4 expert blocks without their scales, or scales alone: {sorted(waiting)[:3]}"
            )
