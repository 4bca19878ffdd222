"""`tgserve sparse-search`: a model's own sparse prefill patterns, searched on a real prompt and
written as the `sparse_attention.json` the engine reads from the model's directory.

The model runs once through transformers over `--tokens` tokens of text (a file given, or by
default the English of Python's own documentation topics, which every Python ships), with an
attention function registered through transformers' `AttentionInterface` that hands each layer's
queries and keys (after rotary) to `kernels.sparse.search` before attending as SDPA does. Search at
the length the model will serve long prompts at (on a GPU for 128K), with the budget serving uses.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def add_sparse_search_command(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "sparse-search", help="search a model's sparse prefill patterns and write sparse_attention.json"
    )
    p.add_argument("--model-id", required=True, help="local directory, .gguf file or hub id")
    p.add_argument("--revision", default=None)
    p.add_argument("--tokens", type=int, default=8192, help="prompt length searched on")
    p.add_argument(
        "--budget", type=int, default=2048, help="keys kept per query (serving's default is about 7K)"
    )
    p.add_argument(
        "--text", type=Path, help="a text file to search on (default: Python's documentation topics)"
    )
    p.add_argument(
        "--min-seq-len", type=int, default=32768, help="prompts from this length take the patterns"
    )
    p.add_argument(
        "--out", type=Path, help="where to write (default: sparse_attention.json beside the model)"
    )
    p.add_argument(
        "--evaluate",
        type=Path,
        help="score this pattern file on the text instead of searching (text it was not chosen on)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--trust-remote-code", action="store_true")
    p.set_defaults(handler=run_sparse_search)


def default_text() -> str:
    """Long natural English: the documentation topics CPython ships (pydoc_data), about 800 KB."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def prompt_ids(tokenizer: Any, text: str, tokens: int) -> list[int]:
    """The first `tokens` token ids of `text`, tokenizing only as much of it as that takes."""
    chars = 8 * tokens
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens or chars >= len(text):
            return ids[:tokens]
        chars *= 2


def run_sparse_search(args: argparse.Namespace) -> int:
    import torch

    from tgserve.kernels.sparse.config import SparseConfig, load_sparse_config
    from tgserve.kernels.sparse.search import config_json
    from tgserve.server.loading.source import load_tokenizer, resolve_model

    source = resolve_model(args.model_id, args.revision)
    tokenizer = load_tokenizer(source, args.trust_remote_code)
    text = args.text.read_text() if args.text else default_text()
    ids = prompt_ids(tokenizer, text, args.tokens)
    if len(ids) < args.tokens:
        raise SystemExit(f"sparse-search: the text has {len(ids)} tokens, fewer than --tokens {args.tokens}")
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    given = load_sparse_config(args.evaluate) if args.evaluate else None
    config = given or SparseConfig()
    start = time.perf_counter()
    layers = search_model(source, ids, args.budget, config, device, args.trust_remote_code, given)
    if given is not None:
        print(summary(layers, time.perf_counter() - start, None))
        return 0
    about = {"tokens": args.tokens, "budget": args.budget, "text": str(args.text or "pydoc_data.topics")}
    data = config_json(layers, args.min_seq_len, config.block, config.last_q, about)
    out = args.out or Path(source.directory) / "sparse_attention.json"
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(summary(layers, time.perf_counter() - start, out))
    return 0


def search_model(
    source: Any,
    ids: list[int],
    budget: int,
    config: Any,
    device: Any,
    trust_remote_code: bool,
    given: Any = None,
) -> dict[int, list]:
    """Every layer's `HeadChoice`s, from one forward over `ids` with the search in its attention;
    with `given` patterns (a `SparseConfig`), their scores beside the default split's instead."""
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tgserve.kernels.sparse.search import evaluate_layer, search_layer

    layers: dict[int, list] = {}

    def searched_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        # query [1, H, n, d], key [1, Hkv, n, d], rotated.
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        q, k, layer = query[0].transpose(0, 1), key[0].transpose(0, 1), module.layer_idx
        if given is None:
            layers[layer] = search_layer(q, k, scale, budget, config.block, config.last_q)
        else:
            patterns = given.head_patterns(layer, q.shape[1], seq_len=q.shape[0])
            layers[layer] = evaluate_layer(q, k, scale, patterns, budget, config.block, config.last_q)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register("tgserve_sparse_search", searched_attention)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(
        source.directory, gguf_file=source.gguf_file, dtype=dtype, trust_remote_code=trust_remote_code,
        attn_implementation="tgserve_sparse_search",
    ).to(device)  # fmt: skip
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids], device=device), logits_to_keep=1)  # one row of logits, not n
    return dict(sorted(layers.items()))


def summary(layers: dict[int, list], seconds: float, out: Path | None) -> str:
    """What was chosen (or evaluated: `out` None), layer by layer, and the mass kept against the
    default split's at the same budget."""
    done = f"written to {out}" if out is not None else "patterns evaluated"
    lines = [f"sparse-search: {len(layers)} layers in {seconds:.1f} s, {done}", ""]
    lines += ["| layer | kinds chosen | mass kept (mean) | default split, same budget |", "|---|---|---|---|"]
    for layer, choices in layers.items():
        kinds: dict[str, int] = {}
        for c in choices:
            kinds[c.pattern.kind] = kinds.get(c.pattern.kind, 0) + 1
        chosen = sum(c.mass for c in choices) / len(choices)
        default = sum(c.default_mass for c in choices) / len(choices)
        named = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
        lines.append(f"| {layer} | {named} | {chosen:.4f} | {default:.4f} |")
    return "\n".join(lines)
