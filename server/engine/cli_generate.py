"""`tgserve generate`: the offline API from the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def _env(name: str, default: Any = None) -> Any:
    return os.environ.get(name, default)


def add_generate_command(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="generate text offline for one or more prompts")
    p.add_argument(
        "--model-id",
        default=_env("MODEL_ID"),
        help="hub id, local directory or .gguf file (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--revision", default=_env("REVISION"))
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for several")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user turn with the tokenizer's chat template",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string; repeat for several")
    p.add_argument("--dtype", default=_env("DTYPE", "auto"))
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--quantize", default=_env("QUANTIZE"), help="fp8: projections stored and multiplied in fp8"
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=_env("KV_CACHE_DTYPE", "auto"),
        choices=["auto", "fp8", "fp8_e4m3", "fp8_e4m3fn"],
        help="auto (the model's dtype) or fp8: e4m3 with a scale per token and KV head",
    )
    p.add_argument("--trust-remote-code", action="store_true", default=_env("TRUST_REMOTE_CODE") == "true")
    p.add_argument(
        "--programmatic-dependent-launch",
        choices=["true", "false"],
        default="false" if _env("TGSERVE_PDL") == "0" else "true",
        help="launch each decode kernel over the tail of the one before (CUDA, Hopper and later)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(handler=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from tgserve.server.engine.llm import LLM
    from tgserve.server.loading.errors import ModelLoadError, ModelNotFoundError
    from tgserve.server.models.registry import UnsupportedModelError
    from tgserve.server.protocol.params import InvalidRequestError, SamplingParams

    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop=tuple(args.stop),
        )
        llm = LLM(
            args.model_id,
            revision=args.revision,
            dtype=args.dtype,
            device=args.device,
            quantize=args.quantize,
            kv_cache_dtype=args.kv_cache_dtype,
            trust_remote_code=args.trust_remote_code,
            programmatic_dependent_launch=args.programmatic_dependent_launch == "true",
        )
        prompts = [_chat(llm, p) for p in args.prompt] if args.chat else args.prompt
        outputs = llm.generate(prompts, params)
    except (InvalidRequestError, ModelNotFoundError, ModelLoadError, UnsupportedModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for out in outputs:
        if args.json:
            print(
                json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason})
            )
        else:
            print(out.text)
    return 0


def _chat(llm: Any, prompt: str) -> str:
    messages = [{"role": "user", "content": prompt}]
    return llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
