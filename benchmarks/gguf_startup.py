"""Start-up time of a GGUF model: the offline API's load, and a server's time to be ready.

    python benchmarks/gguf_startup.py [--model FILE.gguf] [--repeats 2]

Each measure runs in a fresh Python process, as a user's start does (imports included). Offline:
`LLM(model)` until it returns, with server/loading/gguf_parsing.py's `parsed_once` in place and, as the
baseline in the same run, replaced by a block that does nothing (transformers then parses the file
for the config, the tokenizer and the weights, as before); both must give the same greedy tokens.
Server: `tgserve serve` from its launch until `/health` answers 200 (the current code only; run the
script from an earlier checkout for that baseline). Default model: SmolLM2-135M-Instruct's GGUF.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

OFFLINE = """
import contextlib, json, sys, time
import tgserve.server.engine.factory as engine
if sys.argv[2] == "off":
    engine.parsed_once = contextlib.nullcontext
from tgserve import LLM, SamplingParams
start = time.perf_counter()
llm = LLM(sys.argv[1] or None)
seconds = time.perf_counter() - start
out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_new_tokens=12))[0]
print(json.dumps({"seconds": seconds, "tokens": out.token_ids}))
"""


def offline_load(model: str, parse_once: bool) -> dict:
    """{"seconds", "tokens"} of one LLM() load in a new process."""
    mode = "on" if parse_once else "off"
    done = subprocess.run(
        [sys.executable, "-c", OFFLINE, model, mode], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_ready(model: str, timeout: float = 600.0) -> float:
    """Seconds from launching `tgserve serve` until /health answers 200."""
    port = free_port()
    command = [os.path.join(os.path.dirname(sys.executable), "tgserve"), "serve", "--hostname", "127.0.0.1",
               "--port", str(port), *(["--model-id", model] if model else [])]  # fmt: skip
    start = time.perf_counter()
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - start < timeout:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode} before it was ready")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    if response.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"not ready after {timeout} s")
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="a .gguf file (default: the packaged SmolLM2)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-server", action="store_true")
    args = parser.parse_args()
    rows = []
    for _ in range(args.repeats):  # interleaved, so that a slower spell of the host hits both
        once, thrice = offline_load(args.model, True), offline_load(args.model, False)
        assert once["tokens"] == thrice["tokens"], "the two loads gave different tokens"
        rows.append((once["seconds"], thrice["seconds"]))
    ready = [] if args.skip_server else [server_ready(args.model) for _ in range(args.repeats)]
    print("| measure | parsed once, s | baseline: parsed per use, s |\n|---|---|---|")
    once, baseline = (" / ".join(f"{seconds:.1f}" for seconds in column) for column in zip(*rows))
    print(f"| LLM() load | {once} | {baseline} |")
    if ready:
        print(f"| tgserve serve until /health is 200 | {' / '.join(f'{s:.1f}' for s in ready)} | - |")


if __name__ == "__main__":
    main()
