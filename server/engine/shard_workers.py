"""Worker processes for tensor-parallel ranks 1..N-1: each holds its shard and runs every step that
rank 0 (the engine) schedules.

Rank 0 broadcasts each `SchedulerOutput` over a gloo group (host objects never go through NCCL);
every rank's runner then prepares the same inputs, runs its shard (the collectives inside the model
keep them in step) and samples from the same gathered logits. All ranks seed their random
generators alike, so unseeded sampling draws the same tokens everywhere and the runners' copies of
each request stay equal (`init_tensor_parallel` seeds them). `None` ends the loop.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import socket
import sys
import threading
import time

import torch

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.core.heap import freeze_startup_heap
from tgserve.server.distributed.tensor_parallel import init_tensor_parallel, shutdown_tensor_parallel
from tgserve.server.engine.model_shard import build_shard
from tgserve.server.loading.description import ModelDescription, eos_token_ids, load_model_description
from tgserve.server.loading.gguf_parsing import parsed_once
from tgserve.server.loading.source import load_tokenizer
from tgserve.server.sampling.guided import GuidedMatchers

logger = logging.getLogger(__name__)


def free_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def shard_device(device: torch.device, rank: int) -> torch.device:
    """One GPU per rank on CUDA; every rank on the CPU otherwise."""
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return device


def start_workers(args: EngineArgs, init_method: str) -> list[mp.process.BaseProcess]:
    """Ranks 1..N-1, each in a spawned process (a fresh interpreter: no CUDA state inherited)."""
    context = mp.get_context("spawn")
    workers = [
        context.Process(
            target=worker_main, args=(rank, args, init_method), daemon=True, name=f"tgserve-shard-{rank}"
        )
        for rank in range(1, args.tensor_parallel_size)
    ]
    for worker in workers:
        worker.start()
    return workers


def worker_main(rank: int, args: EngineArgs, init_method: str) -> None:
    tp = init_tensor_parallel(rank, args.tensor_parallel_size, init_method)
    with parsed_once():  # a GGUF file's config and weights from one parse
        described = load_model_description(args)
        shard = build_shard(args, described, shard_device(described.device, rank), tp)
    # Guided rows are masked on every rank alike, from the same tokenizer, loaded when first needed.
    shard.runner.guided = GuidedMatchers(
        lambda: _tokenizer_and_eos(args, described),
        int(described.config.vocab_size),
        args.guided_decoding_backend,
        pinned=shard.device.type == "cuda",
    )
    freeze_startup_heap(f"shard worker {rank}")
    # Each step is launched before the last one's tokens are read, as rank 0 does with async
    # scheduling: a worker whose host waited for its GPU would hold every rank at the next collective.
    in_flight = None
    while True:
        scheduler_output = tp.broadcast_object(None)
        if scheduler_output is None:
            break
        launched = shard.runner.launch(scheduler_output)
        if in_flight is not None:
            shard.runner.collect(in_flight)
        in_flight = launched
    shutdown_tensor_parallel()
    exit_without_teardown()


def _tokenizer_and_eos(args: EngineArgs, described: ModelDescription) -> tuple:
    tokenizer = load_tokenizer(described.source, args.trust_remote_code)
    return tokenizer, eos_token_ids(described.config, tokenizer, described.source)


def exit_without_teardown() -> None:
    """End this worker now, its output flushed, skipping the interpreter's finalization.

    A gloo thread may still be releasing the last collective's tensors when the loop ends; that
    takes the GIL, and a thread taking it while the interpreter finalizes is ended by Python inside
    a C++ destructor: std::terminate, SIGABRT ("terminate called without an active exception"),
    seen in 2 of 60 start-generate-close cycles on a 2-core host. Nothing is left to clean up.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class WorkerWatch:
    """Ends this process, saying why, when a shard worker dies before `stop()`.

    Rank 0 would otherwise wait in the process group's rendezvous or in a collective until its
    timeout (30 minutes): a worker that fails while loading its shard hangs the server's start.
    The main thread may be blocked inside such a wait, where no exception can reach it, so the
    watch exits the process; the launcher then reports the engine's exit.
    """

    def __init__(self, workers: list[mp.process.BaseProcess], poll_s: float = 0.5) -> None:
        self.workers, self.poll_s = workers, poll_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tgserve-shard-watch", daemon=True)
        self._thread.start()
        # At interpreter exit multiprocessing terminates daemon workers; atexit runs hooks last
        # registered first, so this one stops the watch before that.
        atexit.register(self.stop)

    def stop(self) -> None:
        """From here on workers may exit (the engine is closing them)."""
        self._stopping.set()

    def dead_worker(self, wait_s: float = 0.0) -> str | None:
        """Why the shards cannot go on, if a worker has exited (waiting up to wait_s for one to)."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = next((w for w in self.workers if w.exitcode is not None), None)
            if dead is not None:
                return (
                    f"shard worker {dead.name} (pid {dead.pid}) exited with code {dead.exitcode}; "
                    "the other shards cannot go on without it"
                )
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _watch(self) -> None:
        while not self._stopping.wait(self.poll_s):
            why = self.dead_worker()
            if why is not None and not self._stopping.is_set():
                print(f"tgserve: {why}, stopping the engine", file=sys.stderr, flush=True)
                os._exit(1)
