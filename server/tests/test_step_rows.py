"""A step's host-built input columns: prompt spans as tensors, decode rows as ints, in order."""

from __future__ import annotations

import random

import pytest
import torch

from tgserve.server.execution.step_rows import HostRows, span_slots


@pytest.mark.parametrize("start,end", [(0, 1), (0, 16), (3, 9), (5, 40), (16, 33), (31, 97)])
def test_span_slots_are_the_per_token_slots(start, end):
    block_size = 16
    block_ids = random.Random(start * 100 + end).sample(range(1000), 8)
    want = [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
    got = span_slots(block_ids, start, end, block_size)
    assert got.dtype == torch.int64 and got.tolist() == want


def test_host_rows_join_ints_and_tensors_in_order():
    rows = HostRows()
    rows.append(7)
    assert len(rows) == 1
    rows.extend_tensor(torch.arange(10, 13))
    for value in (1, 2, 3):
        rows.append(value)
    rows.extend_tensor(torch.tensor([42]))
    assert len(rows) == 8
    got = rows.to(torch.device("cpu"))
    assert got.dtype == torch.int64 and got.tolist() == [7, 10, 11, 12, 1, 2, 3, 42]


def test_host_rows_empty_and_single_part():
    assert HostRows().to(torch.device("cpu")).tolist() == []
    only = HostRows()
    only.extend_tensor(torch.arange(3))
    assert only.to(torch.device("cpu")).tolist() == [0, 1, 2]
