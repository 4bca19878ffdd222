"""For HF models with no KV cache to hand over: the whole sequence, each step.

Two kinds: models whose forward takes no cache (GPT-1, XLM, XLNet, CPM-Ant), and models whose
layers keep state besides softmax attention's keys and values, which the paged cache cannot hold
(Mamba, RWKV, linear-attention hybrids such as Qwen3.5 and Jamba, convolutional ones such as LFM2:
`registry.state_beside_keys_and_values`). These keep their state in transformers' own cache
when transformers generates; served here, they keep it too (below).

transformers generates with a model of the first kind by running it over the whole sequence for
every token (XLM and XLNet through inputs of their own, a mask token or a permutation mask appended by their
`prepare_inputs_for_generation`). The engine does the same: the paged cache keeps each sequence's
token ids (one float32 "head" of width 1 a position, exact for ids below 2**24), so chunked
prefill, prefix caching, preemption and swapping work as for any model, and each logits row is the
model's last logits over the sequence's tokens up to that row, inputs prepared as `generate`
prepares them. The cost is a forward over the whole sequence per logits row: fine for the small
old models that need it, as it is in transformers. The stateful ones keep transformers' cache of
each sequence between steps (`kept_states.py`): a sequence's next token then costs one token's
forward, as in `generate`, and only a sequence with no state for its tokens (its first logits row,
or one whose state was evicted) is run whole.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torch import nn

from tgserve.server.attention.forward_context import get_forward_context
from tgserve.server.kv_cache.spec import KVCacheSpec
from tgserve.server.models.generation_steps import continuation_error, continue_generation, start_generation
from tgserve.server.models.kept_states import KeptStates, prefix_and_whole_keys

logger = logging.getLogger(__name__)

# The cache's one layer: a position's token id, exactly (float32 holds integers below 2**24).
TOKEN_ID_SPEC = KVCacheSpec(num_kv_heads=1, head_dim=1, dtype=torch.float32)


# A kept state continues a sequence only where one-token steps reproduce the uncached forward
# (relative to the logits' size). Measured in float32 on the sweep's tiny models: 1e-7 to 2e-6 for
# all but Bamba, 4.5e-3 (its chunked scan against its recurrent step; generate takes the latter),
# while RecurrentGemma's cached steps are off by 0.7 and steps fed the wrong token by 1.0-1.5 (Mamba,
# Jamba, Qwen3.5): the bound lies between the two.
CONTINUATION_TOLERANCE = {torch.float32: 1e-2, torch.float16: 5e-2, torch.bfloat16: 5e-2}
# Kept states before the engine sizes them (`KeptStates.max_states`, `max_bytes`).
DEFAULT_KEPT_STATES, DEFAULT_KEPT_BYTES = 64, 1 << 30

# Models that take a `Cache` but attend in ways a paged cache cannot serve, by type and why.
RECOMPUTED_MODEL_TYPES = {
    "cpmant": "it attends over prompt tokens it adds to every input itself, with masks of its own making",
}


def is_recomputed(model_class: type, model_type: str) -> bool:
    """Whether the HF class runs over whole sequences here: its forward takes no `Cache` object (no
    `use_cache` with a `cache` / `past_key_values` argument: GPT-1 takes neither, XLNet its own
    `mems`, XLM a legacy dict), or its type is one of RECOMPUTED_MODEL_TYPES."""
    parameters = inspect.signature(model_class.forward).parameters
    takes_cache = "use_cache" in parameters and bool({"cache", "past_key_values"} & set(parameters))
    return not takes_cache or model_type in RECOMPUTED_MODEL_TYPES


class RecomputingFallbackModel(nn.Module):
    """Wraps such a `*LMHeadModel` so that it takes the engine's flat batch: token ids in, each
    sequence's ids kept in the paged cache, logits of the rows asked for out."""

    kv_cache_specs = [TOKEN_ID_SPEC]

    def __init__(self, hf_model: nn.Module, keep_state: bool = False) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.config = hf_model.config
        self.kept_states = self._kept_states() if keep_state else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        ctx, rows = get_forward_context(), logits_indices.tolist()
        meta, ids = ctx.metadata, ctx.kv_caches[0][0].view(-1)  # [slots]: one token id a slot
        written = meta.slot_mapping >= 0  # padding rows of a static-shape step write nothing
        ids[meta.slot_mapping[written]] = input_ids[written].to(ids.dtype)
        starts, block_size = meta.query_start_loc_cpu, meta.block_size
        logits = []
        for row in rows:
            seq = next(i for i in range(meta.num_seqs) if starts[i] <= row < starts[i + 1])
            length = meta.seq_lens_cpu[seq] - (starts[seq + 1] - 1 - row)  # tokens up to this row's
            table = meta.block_tables[seq, : -(-length // block_size)].long()
            slots = (table[:, None] * block_size + torch.arange(block_size, device=table.device)).view(-1)
            logits.append(self._row_logits(ids[slots[:length]].long()))
        if not logits:
            return torch.empty(0, self.config.vocab_size, device=input_ids.device)
        return torch.stack(logits)

    def _row_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The last logits of `tokens`: by one token's step from the state kept for all but the last
        token where there is one, else by a forward over them all (which keeps its state)."""
        if self.kept_states is None:
            return self._last_logits(tokens)
        prefix_key, key = prefix_and_whole_keys(tokens.cpu())
        state = self.kept_states.take(prefix_key)
        try:
            if state is None:
                logits, state = start_generation(self.hf_model, tokens[None])
            else:
                logits, state = continue_generation(self.hf_model, tokens[None], state)
        except torch.OutOfMemoryError:  # the kept states took what the step needed: drop them, recompute
            logger.warning("out of device memory with %d kept states (%.2f GiB): dropped",
                           len(self.kept_states), self.kept_states.bytes / (1 << 30))  # fmt: skip
            del state
            self.kept_states.clear()
            return self._last_logits(tokens)
        self.kept_states.keep(key, state)
        return logits

    def _kept_states(self) -> KeptStates | None:
        """States kept between steps, where one-token steps over transformers' cache reproduce the
        uncached forward (checked on random tokens, on the model's device); else None, and the log
        says the steps are recomputed."""
        name, dtype = type(self.hf_model).__name__, next(self.hf_model.parameters()).dtype
        device = next(self.hf_model.parameters()).device
        try:
            error = continuation_error(self.hf_model, self._last_logits, device)
        except Exception as exc:  # the model's generation inputs do not take one-token steps here
            error, why = float("inf"), f"{type(exc).__name__}: {exc}"
        else:
            why = f"relative error {error:.2g} against its uncached forward"
        if error > CONTINUATION_TOLERANCE.get(dtype, 5e-2):
            logger.warning("%s: each token is computed by a forward over its whole sequence: one-token steps "
                           "over transformers' cache do not reproduce it (%s)", name, why)  # fmt: skip
            return None
        logger.info("%s: each sequence's state is kept between steps (one token's forward a step; %s)",
                    name, why)  # fmt: skip
        return KeptStates(DEFAULT_KEPT_STATES, DEFAULT_KEPT_BYTES)

    def _last_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs: dict[str, Any] = self.hf_model.prepare_inputs_for_generation(
            tokens[None], use_cache=False, is_first_iteration=True
        )
        inputs = {name: value for name, value in inputs.items() if value is not None}
        return self.hf_model(**inputs).logits[0, -1]
