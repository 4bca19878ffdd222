"""Guided requests wait here, outside the scheduler, while their grammars compile.

A grammar can take from a fraction of a millisecond to seconds to compile (its schema's size and
shape decide). Compiling it when the request is first scheduled would stall that step, and so
every request in the batch; instead the engine holds a guided request here when it arrives, hands
its grammar to every runner with the next step (`SchedulerOutput.grammars_to_prepare`; each
compiles it on a worker thread, `GuidedMatchers.prepare`), and passes the request to the
scheduler once rank 0's matcher is built, in arrival order among those ready.
"""

from __future__ import annotations

from tgserve.server.core.request import Request
from tgserve.server.protocol.params import GuidedDecoding
from tgserve.server.sampling.guided import GuidedMatchers


class GrammarGate:
    def __init__(self) -> None:
        self._held: dict[str, Request] = {}  # arrival order
        self._arrived: list[tuple[str, GuidedDecoding]] = []  # not yet handed to the runners

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, request: Request) -> None:
        assert request.sampling_params.guided is not None
        self._held[request.request_id] = request
        self._arrived.append((request.request_id, request.sampling_params.guided))

    def take_arrivals(self) -> tuple[tuple[str, GuidedDecoding], ...]:
        """The grammars for the runners to start compiling with this step."""
        arrived, self._arrived = tuple(self._arrived), []
        return arrived

    def release_ready(self, guided: GuidedMatchers) -> list[Request]:
        """The held requests whose matchers are built, in arrival order; they leave the gate."""
        ready = [request for request_id, request in self._held.items() if guided.is_prepared(request_id)]
        for request in ready:
            del self._held[request.request_id]
        return ready

    def abort(self, request_ids: list[str], guided: GuidedMatchers) -> list[str]:
        """Drop those held here; returns them (the other runners' matchers are dropped with a step)."""
        dropped = [request_id for request_id in request_ids if self._held.pop(request_id, None) is not None]
        for request_id in dropped:
            guided.remove(request_id)
        self._arrived = [(i, spec) for i, spec in self._arrived if i not in dropped]
        return dropped
