"""The host tier of the prefix cache through the server (--kv-offload-gb): a prefix evicted from the
KV pool comes back from host memory with the text recomputation gives, and streams aborted while
their steps move blocks leak no block of either pool, as /metrics reads."""

from __future__ import annotations

import asyncio

import httpx

# A pool of 24 blocks of 16 tokens; 1 MiB of host tier (128 of the tiny model's 8 KiB blocks).
ARGS = ["--max-input-tokens", "200", "--max-total-tokens", "256", "--max-batch-total-tokens", "384",
        "--kv-offload-gb", str(2**-10)]  # fmt: skip


def _prompt(topic: str, words: int = 40) -> str:
    return " ".join(f"{topic}{i}" for i in range(words))


def test_an_evicted_prefix_comes_back_from_host_and_aborts_leak_nothing(start_server, tiny_model):
    server = start_server(["--model-id", tiny_model, *ARGS], name="host-tier")
    shared = _prompt("council", 15)  # about 100 tokens
    body = {"parameters": {"max_new_tokens": 12, "do_sample": False}}

    def generate(prompt: str) -> str:
        response = httpx.post(f"{server.url}/generate", json={"inputs": prompt, **body}, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["generated_text"]

    computed = generate(shared + " and then")
    for topic in ("river", "mountain", "harbour"):  # each fills most of the pool: the prefix is evicted
        generate(_prompt(topic, 26))
    assert generate(shared + " and then") == computed
    gauges = server.wait_until_idle()
    assert gauges["tgserve_kv_host_prefix_hits"] > 0 and gauges["tgserve_kv_host_loaded_blocks"] > 0
    assert gauges["tgserve_kv_host_loaded_bytes"] == 8192 * gauges["tgserve_kv_host_loaded_blocks"]

    async def stream(client: httpx.AsyncClient, prompt: str, abort: bool) -> None:
        request = {"inputs": prompt, "parameters": {"max_new_tokens": 40, "do_sample": False}}
        async with client.stream("POST", "/generate_stream", json=request) as response:
            assert response.status_code == 200
            chunks = 0
            async for line in response.aiter_lines():
                chunks += line.startswith("data:")
                if abort and chunks == 2:
                    return  # leaving the block closes the connection mid-stream

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            prompts = [shared + f" question {i}" if i % 2 else _prompt(f"lake{i}", 20) for i in range(8)]
            await asyncio.gather(*(stream(client, p, abort=i % 3 == 0) for i, p in enumerate(prompts)))

    before = server.gauges()["tgserve_kv_host_loaded_blocks"]
    asyncio.run(run())
    gauges = server.wait_until_idle()
    assert gauges["tgserve_kv_cache_free_blocks"] == gauges["tgserve_kv_cache_total_blocks"]
    assert gauges["tgserve_kv_host_used_blocks"] <= gauges["tgserve_kv_host_total_blocks"]
    assert gauges["tgserve_kv_host_loaded_blocks"] >= before
