"""Sparse-vs-dense prefill agreement on a trained model (issue 5, (c)): greedy continuations of long
prompts after a sparse prefill against the same after a dense one.

No long-context model can be downloaded here, so the model is SmolLM2-135M-Instruct (the GGUF the
project ships) with its RoPE scaled linearly (factor 4) to reach 32K tokens: a trained model whose
attention has the real structure sparse patterns rely on (sinks, locality, salient tokens), run
four times past its training length. The prompts are real text: the Python standard library's
sources, read from different offsets. For each prompt, both runs generate --new-tokens greedily
after a prefill of --prompt-tokens; reported: first-token agreement, the mean share of positions
equal before the first difference, and both prefill times. The noise floor beside them: the same
for dense against dense with the prompt in two chunks, exact attention in other bf16 arithmetic.

Run on a GPU: python benchmarks/sparse_agreement.py --gguf PATH [--prompts 16 --prompt-tokens 32768]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.protocol.params import SamplingParams

ROPE_FACTOR = 4.0


def write_scaled_model(gguf: Path, out: Path, context: int) -> None:
    """The GGUF's model as bf16 safetensors, its RoPE scaled linearly to `context` positions."""
    from transformers import AutoModelForCausalLM

    from tgserve.server.loading.source import ModelSource, load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    config = model.config
    if hasattr(config, "quantization_config"):  # dequantised already: saved as plain weights
        del config.quantization_config
    theta = config.rope_parameters["rope_theta"]
    config.rope_parameters = {"rope_type": "linear", "factor": ROPE_FACTOR, "rope_theta": theta}
    config.max_position_embeddings = context
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict(model.state_dict())
    fresh.save_pretrained(out)
    load_tokenizer(ModelSource(gguf.parent, gguf.name)).save_pretrained(out)


def stdlib_text() -> str:
    """The standard library's Python sources, in a fixed order: megabytes of real text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 20_000)
    return "\n\n".join(p.read_text(errors="replace") for p in files)


def long_prompts(engine: LLMEngine, count: int, length: int) -> list[list[int]]:
    ids = engine.tokenizer(stdlib_text())["input_ids"]
    if len(ids) < length + count * 1000:
        raise SystemExit(f"only {len(ids)} tokens of text for {count} prompts of {length}")
    stride = (len(ids) - length) // count
    return [ids[i * stride : i * stride + length] for i in range(count)]


def continuation(engine: LLMEngine, prompt: list[int], new_tokens: int, name: str) -> tuple[list[int], float]:
    """Greedy tokens after `prompt`, and the seconds to the first of them."""
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start, first, tokens = time.perf_counter(), None, []
    engine.add_request(name, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            if first is None and tokens:
                first = time.perf_counter() - start
    return tokens, first or float("nan")


def agreement(dense: list[int], sparse: list[int]) -> float:
    """The share of positions equal before the first difference."""
    same = next((i for i, (a, b) in enumerate(zip(dense, sparse, strict=True)) if a != b), len(dense))
    return same / len(dense)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    context = args.prompt_tokens + args.new_tokens + 64
    with tempfile.TemporaryDirectory() as tmp:
        write_scaled_model(args.gguf, Path(tmp), context)
        engine = LLMEngine(
            EngineArgs(
                model=tmp,
                max_model_len=context,
                max_num_seqs=1,
                max_num_batched_tokens=args.prompt_tokens,  # sparse prefill needs the prompt in one step
                enable_prefix_caching=False,
                sparse_min_seq_len=args.prompt_tokens,
                gpu_memory_utilization=0.5,
            )
        )
        backend = engine.runner.forward.backend
        sparse_config = getattr(backend, "sparse", None)  # only the cuda backend has sparse prefill
        prompts = long_prompts(engine, args.prompts, args.prompt_tokens)
        continuation(engine, prompts[0][:4096], 2, "warm-up")
        rows = []
        whole = engine.scheduler.config
        halves = dataclasses.replace(whole, max_num_batched_tokens=args.prompt_tokens // 2)
        for i, prompt in enumerate(prompts):
            backend.sparse = None
            dense, dense_s = continuation(engine, prompt, args.new_tokens, f"dense-{i}")
            backend.sparse = sparse_config
            sparse, sparse_s = continuation(engine, prompt, args.new_tokens, f"sparse-{i}")
            # The noise floor: dense again, the prompt in two chunks (the paged kernel for the second):
            # the same attention in other bf16 arithmetic.
            backend.sparse, engine.scheduler.config = None, halves
            chunked, _ = continuation(engine, prompt, args.new_tokens, f"chunked-{i}")
            engine.scheduler.config = whole
            rows.append({"first": dense[0] == sparse[0], "agree": agreement(dense, sparse),
                         "first_chunked": dense[0] == chunked[0], "agree_chunked": agreement(dense, chunked),
                         "dense_s": dense_s, "sparse_s": sparse_s})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    summary = {
        "prompts": len(rows),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "first_token_agreement": sum(r["first"] for r in rows) / len(rows),
        "mean_prefix_agreement": sum(r["agree"] for r in rows) / len(rows),
        "noise_floor_first_token": sum(r["first_chunked"] for r in rows) / len(rows),
        "noise_floor_mean_prefix": sum(r["agree_chunked"] for r in rows) / len(rows),
        "dense_ttft_s": sorted(r["dense_s"] for r in rows)[len(rows) // 2],
        "sparse_ttft_s": sorted(r["sparse_s"] for r in rows)[len(rows) // 2],
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
    print(json.dumps(summary))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
