"""Mixtures of experts on the llama family's layers: Qwen3-MoE, Qwen2-MoE and Mixtral, native.

Attention, norms and rotary are Llama's (Qwen3-MoE norms queries and keys as Qwen3 does, Qwen2-MoE
biases its QKV projection as Qwen2 does, Mixtral's window comes through the KV cache spec). The
feed-forward block of a sparse layer is a router (softmax over every expert, the top k, Mixtral
and `norm_topk_prob` renormalising them) and the experts, SwiGLU each, whose weights are stacked
per layer as [E, 2I, H] (gate and up) and [E, H, I] (down) for the grouped GEMMs of
`kernels/moe.py` (the twin on CPU). Qwen2-MoE adds a shared expert, a dense MLP gated by a
sigmoid. Qwen layers listed in `mlp_only_layers` or off the `decoder_sparse_step` keep a dense MLP.

Tensor parallelism splits every expert's intermediate size across the shards (each holds all the
experts, as vLLM's default does); the router is on every shard. Checkpoints name experts one by
one (`mlp.experts.{e}.gate_proj`, Mixtral's `block_sparse_moe.experts.{e}.w1`); transformers 5's
stacked names (`mlp.experts.gate_up_proj`) are read too. --quantize fp8 leaves the experts in the
model's dtype; an fp8 checkpoint's experts are dequantized to it as they load (its attention
projections stay fp8).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tgserve.kernels import dispatch
from tgserve.server.distributed.tensor_parallel import tensor_parallel
from tgserve.server.models.llama import ROWS_AT_ONCE, LlamaForCausalLM, LlamaMLP, load_fused_weights

# Checkpoint names of one expert's projections -> (stacked tensor, part): 0 gate, 1 up (rows of
# gate_up), 0 down. Mixtral: w1 gate, w3 up, w2 down.
EXPERT_PARTS = {
    "gate_proj": ("w_gate_up", 0), "up_proj": ("w_gate_up", 1), "down_proj": ("w_down", 0),
    "w1": ("w_gate_up", 0), "w3": ("w_gate_up", 1), "w2": ("w_down", 0),
}  # fmt: skip
_ONE_EXPERT = re.compile(
    r"^(?P<layer>.+\.mlp)\.experts\.(?P<expert>\d+)\.(?P<part>\w+)\.(?P<kind>weight|weight_scale|input_scale)$"
)
_STACKED = re.compile(r"^(?P<layer>.+\.mlp)\.experts\.(?P<part>gate_up_proj|down_proj)$")


def num_experts(config: Any) -> int:
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0) or 0)


def is_sparse_layer(config: Any, layer: int) -> bool:
    """Whether a layer's feed-forward block is a mixture of experts (Qwen's placement rules;
    Mixtral's every layer)."""
    if config.model_type == "mixtral":
        return True
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    only_mlp = set(getattr(config, "mlp_only_layers", None) or [])
    return num_experts(config) > 0 and layer not in only_mlp and (layer + 1) % step == 0


class ExpertWeights(nn.Module):
    """A layer's experts, stacked: w_gate_up [E, 2 I_shard, H], w_down [E, H, I_shard]."""

    def __init__(self, experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.tp = tensor_parallel()
        self.intermediate = self.tp.divide(intermediate, "expert intermediate size")  # this shard's
        self.w_gate_up = nn.Parameter(torch.empty(experts, 2 * self.intermediate, hidden))
        self.w_down = nn.Parameter(torch.empty(experts, hidden, self.intermediate))
        self.loaded: set[tuple[str, int, int]] = set()

    def load_expert(self, expert: int, name: str, part: int, tensor: torch.Tensor) -> None:
        """One checkpoint projection of one expert: this shard's rows of gate or up, or its columns
        of down."""
        size, start = self.intermediate, self.tp.rank * self.intermediate
        if name == "w_gate_up":
            self.w_gate_up.data[expert, part * size : (part + 1) * size].copy_(tensor.narrow(0, start, size))
        else:
            self.w_down.data[expert].copy_(tensor.narrow(1, start, size))
        self.loaded.add((name, part, expert))

    def load_stacked(self, name: str, tensor: torch.Tensor) -> None:
        """transformers 5's stacked experts: gate_up_proj [E, 2I, H] or down_proj [E, H, I]."""
        for expert in range(tensor.shape[0]):
            if name == "gate_up_proj":
                gate, up = tensor[expert].chunk(2, dim=0)
                self.load_expert(expert, "w_gate_up", 0, gate)
                self.load_expert(expert, "w_gate_up", 1, up)
            else:
                self.load_expert(expert, "w_down", 0, tensor[expert])

    def missing(self) -> list[str]:
        experts = self.w_down.shape[0]
        wanted = {
            (n, p, e) for e in range(experts) for n, p in (("w_gate_up", 0), ("w_gate_up", 1), ("w_down", 0))
        }
        return sorted(f"expert {e} {n}[{p}]" for n, p, e in wanted - self.loaded)


class SparseMoE(nn.Module):
    """Router, experts and (Qwen2-MoE) a sigmoid-gated shared expert."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        experts = num_experts(config)
        intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        self.top_k = int(config.num_experts_per_tok)
        # Mixtral always renormalises the chosen experts' weights and keeps them in float32; Qwen
        # renormalises when norm_topk_prob is set and rounds them to the model's dtype.
        mixtral = config.model_type == "mixtral"
        self.renormalize = mixtral or bool(getattr(config, "norm_topk_prob", False))
        self.round_weights = not mixtral
        self.gate = nn.Linear(config.hidden_size, experts, bias=False)
        self.experts = ExpertWeights(experts, config.hidden_size, intermediate)
        shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        self.shared_expert = LlamaMLP(config, shared) if shared else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if shared else None
        self.tp = tensor_parallel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return in_row_slices(self._rows, x)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        round_to = x.dtype if self.round_weights else None
        # (dispatch.linear: one row's router logits through the skinny kernel, not cuBLAS's GEMM)
        logits = dispatch.linear(x, self.gate.weight)
        weights, ids = dispatch.route(logits, self.top_k, self.renormalize, round_to)
        out = dispatch.fused_moe(x, self.experts.w_gate_up, self.experts.w_down, weights, ids)
        out = self.tp.all_reduce(out)  # each shard's experts hold a slice of the intermediate size
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def in_row_slices(rows: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """rows(x) for a feed-forward block that keeps x's shape, ROWS_AT_ONCE rows at a time: a whole
    long prompt's step never holds its experts' intermediate activations for every row at once."""
    if x.shape[0] <= ROWS_AT_ONCE:
        return rows(x)
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], ROWS_AT_ONCE):
        out[start : start + ROWS_AT_ONCE] = rows(x[start : start + ROWS_AT_ONCE])
    return out


def moe_block_of(config: Any, layer: int) -> nn.Module | None:
    """A sparse layer's mixture of experts; None (Llama's MLP) for the dense ones."""
    return SparseMoE(config) if is_sparse_layer(config, layer) else None


def _dequantized(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """An expert weight as loaded: an e4m3 one times its scale (one a row, or one for the tensor)."""
    if scale is None:
        return weight
    scale = scale.float()
    return weight.float() * (scale.reshape(-1, 1) if scale.numel() == weight.shape[0] else scale.reshape(()))


ExpertPlacer = Callable[
    [Iterable[tuple[str, torch.Tensor]], dict[str, ExpertWeights]], Iterator[tuple[str, torch.Tensor]]
]


def load_with_experts(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], place: ExpertPlacer
) -> None:
    """A mixture-of-experts model's checkpoint: `place` copies the expert tensors into the model's
    `ExpertWeights` (by module name) and passes every other weight on to the llama family's loader;
    every expert parameter is checked filled."""
    modules = {name: m for name, m in model.named_modules() if isinstance(m, ExpertWeights)}
    stacks = [
        f"{name}.{param}" for name, m in modules.items() for param, _ in m.named_parameters(recurse=False)
    ]
    load_fused_weights(model, place(weights, modules), stacks)
    for name, module in modules.items():
        if missing := module.missing():
            raise ValueError(f"checkpoint lacks {len(missing)} expert weights of {name}, e.g. {missing[:3]}")


def experts_of(modules: dict[str, ExpertWeights], layer: str, source: str) -> ExpertWeights:
    """The experts of layer `layer` (a checkpoint name's prefix up to `.mlp`), for weight `source`."""
    module = modules.get(f"{layer}.experts")
    if module is None:
        raise ValueError(f"checkpoint weight {source!r} has no place in this model")
    return module


def _mixtral_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield name.replace(".block_sparse_moe.", ".mlp."), tensor


class MoEForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE, Qwen2-MoE and Mixtral on Llama's layers with SparseMoE feed-forward blocks."""

    mlp_of = moe_block_of
    # On a Gaudi these go to optimum-habana (`fallback_model.fallback_needed`): the twin's expert
    # loop reads the routing on the host, which an HPU graph would record once and replay.
    runs_on_hpu = False

    @staticmethod
    def serves(config: Any) -> bool:
        """Llama's RoPE limits, and SwiGLU experts (the grouped kernel's gating)."""
        return LlamaForCausalLM.serves(config) and config.hidden_act in ("silu", "swish")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_with_experts(self, _mixtral_names(weights), self._placed_experts)

    def _placed_experts(
        self, weights: Iterable[tuple[str, torch.Tensor]], modules: dict[str, ExpertWeights]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Experts' weights copied into their stacks; every other weight passed on. An fp8
        checkpoint's expert weights (e4m3 with a `weight_scale` a row or a tensor) are dequantized
        as they load: the experts stay in the model's dtype; static input scales are unused, as the
        dense projections' are."""
        waiting: dict[str, dict[str, torch.Tensor]] = {}  # an fp8 weight or its scale, until both came
        for name, tensor in weights:
            one, stacked = _ONE_EXPERT.match(name), _STACKED.match(name)
            if stacked:
                experts_of(modules, stacked["layer"], name).load_stacked(stacked["part"], tensor)
            elif not one or one["part"] not in EXPERT_PARTS:
                yield name, tensor
            elif one["kind"] != "input_scale":
                key = name.rsplit(".", 1)[0]
                pair = waiting.setdefault(key, {})
                pair[one["kind"]] = tensor
                weight = pair.get("weight")
                if weight is None or (weight.dtype == torch.float8_e4m3fn and "weight_scale" not in pair):
                    continue
                del waiting[key]
                target, part = EXPERT_PARTS[one["part"]]
                experts = experts_of(modules, one["layer"], name)
                experts.load_expert(
                    int(one["expert"]), target, part, _dequantized(weight, pair.get("weight_scale"))
                )
        if waiting:
            raise ValueError(
                f"checkpoint has fp8 expert weights without their scales, or scales alone: {sorted(waiting)[:3]}"
            )
