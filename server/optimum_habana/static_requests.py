"""What `StaticBatchEngine` does per request, apart from the batch: validation, sampling rows, stop
rules and output deltas. Plain functions over `core.request.Request`, so the static engine and
`LLMEngine` treat a request alike.
"""

from __future__ import annotations

import torch

from tgserve.server.core.request import Request
from tgserve.server.protocol.outputs import RequestOutput, TokenLogprob
from tgserve.server.protocol.params import InvalidRequestError, check_prompt_tokens
from tgserve.server.sampling.sampler import SamplingRow, token_logprobs


def validate_prompt(prompt: list[int], vocab_size: int, max_len: int) -> None:
    """Raise InvalidRequestError naming the limit a prompt breaks: empty, out of vocabulary, too long."""
    check_prompt_tokens(prompt, vocab_size)
    if len(prompt) >= max_len:
        raise InvalidRequestError(
            f"prompt has {len(prompt)} tokens but the static cache holds {max_len} positions per "
            f"sequence (max_model_len): at most {max_len - 1} prompt tokens leave room for one new token"
        )


def sampling_row(request: Request) -> SamplingRow:
    """The request's row for the `Sampler`; `step` (its output length) picks a seeded row's noise."""
    params, step = request.sampling_params, request.num_output_tokens
    if not params.needs_penalties:  # only penalties read the tokens
        return SamplingRow(params, [], [], step)
    return SamplingRow(params, request.prompt_token_ids, request.output_token_ids, step)


def prompt_logprobs(request: Request, logits: torch.Tensor) -> list[TokenLogprob | None] | None:
    """From a prefill's logits `[prompt, vocab]`: None first, then each later prompt token's, if asked."""
    top_n = request.sampling_params.prompt_logprobs
    if top_n is None:
        return None
    targets = torch.tensor(request.prompt_token_ids[1:], dtype=torch.long, device=logits.device)
    scored = token_logprobs(logits[:-1], targets, [top_n] * len(targets)) if len(targets) else []
    return [None, *scored]


def output_delta(
    request: Request,
    logprob: TokenLogprob | None,
    prompt_scores: list[TokenLogprob | None] | None = None,
) -> RequestOutput:
    """The delta of a request that just gained its last output token."""
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=[request.output_token_ids[-1]],
        new_logprobs=[logprob] if logprob is not None else None,
        finished=request.is_finished,
        finish_reason=request.finish_reason.value if request.finish_reason else None,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=0,  # no prefix cache: every prompt is computed
        num_output_tokens=request.num_output_tokens,
        prompt_logprobs=prompt_scores,
        scheduled_at=request.first_scheduled_time,
    )
