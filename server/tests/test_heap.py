"""The engine process's start-up heap is frozen out of full collections; later garbage is still collected."""

from __future__ import annotations

import gc

import pytest

from tgserve.server.core.heap import freeze_startup_heap


@pytest.fixture
def unfrozen_afterwards():
    yield
    gc.unfreeze()  # the rest of the test session keeps its objects collectable


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freeze_keeps_start_up_objects_and_collects_later_cycles(unfrozen_afterwards) -> None:
    survivor = Cycle()
    frozen = freeze_startup_heap("test")
    assert frozen == gc.get_freeze_count() > 0
    assert all(obj is not survivor for obj in gc.get_objects())  # moved to the permanent generation
    later = Cycle()
    del later
    assert gc.collect() >= 1  # serving's own garbage is still found
