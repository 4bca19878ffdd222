"""`tgserve serve --num-shard 2` on CPU: two model shards (the engine and one worker process, gloo)
answer with the tokens of one shard, and stopping the server stops both."""

from __future__ import annotations

import time

import httpx
import pytest
import torch


# On a GPU host each shard takes a GPU of its own.
@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="two shards need two GPUs here"
)
def test_two_shards_serve_the_tokens_of_one(start_server, tiny_model, tiny_server):
    sharded = start_server(["--model-id", tiny_model, "--num-shard", "2"], name="sharded")
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 12, "details": True}}

    def tokens(server) -> list[int]:
        response = httpx.post(f"{server.url}/generate", json=body, headers=server.headers, timeout=60)
        assert response.status_code == 200, response.text
        return [t["id"] for t in response.json()["details"]["tokens"]]

    assert tokens(sharded) == tokens(tiny_server)
    sharded.stop()
    deadline = time.monotonic() + 20
    while sharded.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sharded.process.returncode == 0
