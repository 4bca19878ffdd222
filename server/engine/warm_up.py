"""Requests an engine runs before it serves, so that the first real requests do not pay for the
kernels compiled on first use.

Triton compiles a kernel anew for each specialisation of its arguments (an integer equal to 1 or
divisible by 16, a pointer's alignment, every constexpr) the first time a process meets it, and a
fresh container has no compiled kernels on disk. The start-up pass that sizes the KV pool (when
it runs) is one prompt step over many sequences, and the decode graphs capture pure decode steps;
neither is a lone prompt (SDPA, one row kept for sampling), a kept row whose context the decode
kernel splits, or a step that mixes decode rows with prompt rows (the paged prefill kernel). On an
H200, a fresh machine's first process took 1.0-1.6 s for a 512-token prompt's first token against
0.12-0.17 s once warm, and 0.4-0.5 s longer over 256 prompts.
"""

from __future__ import annotations

import math
import time

from tgserve.kernels.dispatch import CUDNN_MIN_TOKENS
from tgserve.server.engine.interface import Engine
from tgserve.server.protocol.params import SamplingParams

REQUEST_PREFIX = "tgserve-warm-up-"

# Longer than 4 tiles of 64: the CUDA decode kernel splits a context past that over several
# programs (kernels/paged_decode.py, choose_splits), and each prompt's sampled row attends through
# it; shorter prompts alone left the split kernel to compile on the first real long prompt.
SPLIT_CONTEXT = 320
# Tokens each warm-up prompt leaves free of `room` for its new tokens.
NEW_TOKEN_ROOM = 8

# A lone prompt of CUDNN_MIN_TOKENS or more takes cuDNN's attention (kernels/dispatch.py). cuDNN
# compiles its kernel for a length that is not a multiple of its tile the first time a process meets
# one, and a fresh container has no such kernel on disk (CUDA's compute cache): 0.6-0.9 s on an H200,
# on the host, inside the step, against 0.05-0.07 s for a new aligned length. One token past the
# threshold is such a length, and every later one reuses its kernel.
CUDNN_ALONE = CUDNN_MIN_TOKENS + 1


def warm_up_prompts(block_size: int, room: int, vocab_size: int) -> list[list[int]]:
    """Four prompts: a long one, SPLIT_CONTEXT tokens where there is room, of whole blocks and a
    multiple of 16 (Triton specialises integers divisible by 16); a short one likewise; and two
    short ones past a multiple of 16. Each leaves `room` (the tokens a request may hold:
    context and half the KV pool, whichever is less) for a few new tokens."""
    unit = math.lcm(block_size, 16)
    fits = max(1, room - NEW_TOKEN_ROOM)

    def whole(length: int) -> int:
        capped = min(length, fits)
        return capped // unit * unit or capped

    long, short = whole(SPLIT_CONTEXT), whole(2 * unit)
    lengths = (long, short, max(1, min(short + 3, room - 5)), max(1, min(short + 5, room - 5)))
    return [filler_prompt(length, vocab_size) for length in lengths]


def filler_prompt(length: int, vocab_size: int) -> list[int]:
    low = min(100, vocab_size - 1)  # clear of the special tokens most vocabularies start with
    span = max(1, vocab_size - low)
    return [low + (7919 * i + length) % span for i in range(length)]


def cudnn_prompt_length(step_budget: int, room: int, sparse_min_seq_len: int | None) -> int | None:
    """CUDNN_ALONE where a lone prompt of that length can meet cuDNN: one step holds it whole (a
    chunked prompt's later chunks attend through the paged kernel), it stays dense (below the sparse
    threshold), and it leaves `room` for a few new tokens. None where it cannot."""
    dense = sparse_min_seq_len is None or CUDNN_ALONE < sparse_min_seq_len
    fits = CUDNN_ALONE <= step_budget and CUDNN_ALONE + NEW_TOKEN_ROOM <= room
    return CUDNN_ALONE if fits and dense else None


def warm_up(engine: Engine, num_blocks: int, sparse_min_seq_len: int | None, new_tokens: int = 4) -> float:
    """Run the warm-up requests through `engine` (a pool of `num_blocks` KV blocks; prompts of
    `sparse_min_seq_len` tokens or more take sparse attention) to the end; the seconds it took.

    Three kinds of prompt step, each followed by decode steps: the long prompt alone (greedy), run
    to the end, and likewise a lone prompt of CUDNN_ALONE tokens where one can meet cuDNN; then a
    pair of short prompts together, fresh (the varlen prefill kernel); then, one step later, the
    last prompt joining while the pair decodes (decode rows beside prompt rows).
    The pair's second prompt and the last one are sampled with temperature, top-k and top-p so the
    sampler's kernels compile too. Nothing is left behind but the prompts' full blocks in the prefix
    cache, which hold their true KV; the engine's counters are reset.

    The lone prompt is the long one so that the decode kernel splits its kept row's context. A
    lone prompt's attention is SDPA's flash kernel, which compiles nothing; from 12,288 tokens it is
    cuDNN's, which builds a plan for each new length (tens of ms, which no warm-up could cover for
    every length: `dispatch.CUDNN_MIN_TOKENS`) and compiles a kernel for the first unaligned one,
    which the CUDNN_ALONE prompt covers.
    """
    start = time.perf_counter()
    block_size = engine.args.block_size
    room = min(engine.max_model_len, num_blocks * block_size // 2)
    alone, pair_first, pair_second, joining = warm_up_prompts(block_size, room, engine.vocab_size)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    sampled = SamplingParams(
        temperature=0.7, top_k=20, top_p=0.9, seed=0, max_new_tokens=new_tokens, ignore_eos=True
    )
    engine.add_request(f"{REQUEST_PREFIX}0", alone, greedy)
    _run_to_the_end(engine)
    long = cudnn_prompt_length(engine.args.max_num_batched_tokens, room, sparse_min_seq_len)
    if long:
        engine.add_request(f"{REQUEST_PREFIX}cudnn", filler_prompt(long, engine.vocab_size), greedy)
        _run_to_the_end(engine)
    engine.add_request(f"{REQUEST_PREFIX}1", pair_first, greedy)
    engine.add_request(f"{REQUEST_PREFIX}2", pair_second, sampled)
    engine.step()
    engine.add_request(f"{REQUEST_PREFIX}3", joining, sampled)
    _run_to_the_end(engine)
    engine.reset_counters()
    return time.perf_counter() - start


def _run_to_the_end(engine: Engine) -> None:
    while engine.needs_step():
        engine.step()
