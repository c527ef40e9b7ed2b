"""The own step's policy with no model: slot reuse, shape buckets, the per-step token budget."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from engine.step.plan import (MIN_PREFILL_TOKENS, Chunk, SlotTable, StallBudget, plan_prefill, round_up,
                          row_bucket)


def test_a_freed_row_goes_to_the_next_admission():
    table = SlotTable(4)
    rows = [table.acquire() for _ in range(3)]
    assert rows == [0, 1, 2] and table.span == 3
    table.release(1)
    assert table.span == 3  # nothing moves when a sequence leaves
    assert table.acquire() == 1  # the lowest free row: the used span stays short
    table.release(2)
    assert table.span == 2
    table.acquire(), table.acquire()
    with pytest.raises(RuntimeError, match="in use"):
        table.acquire()
    with pytest.raises(ValueError):
        SlotTable(2).release(0)


def test_row_buckets_are_powers_of_two_on_a_gpu_and_exact_on_a_cpu():
    assert [row_bucket(n, 128, on_cpu=False) for n in (1, 2, 3, 5, 9, 33, 100, 128)] == \
        [1, 2, 4, 8, 16, 64, 128, 128]
    assert [row_bucket(n, 128, on_cpu=True) for n in (1, 3, 5, 100)] == [1, 3, 5, 100]
    assert row_bucket(0, 8, on_cpu=False) == 1
    # every span from 1 to 128 maps onto 8 shapes on a GPU
    assert len({row_bucket(n, 128, on_cpu=False) for n in range(1, 129)}) == 8
    assert round_up(257, 256) == 512 and round_up(256, 256) == 256


def test_decoding_sequences_take_their_share_of_the_step_budget():
    waiting = [("a", 500), ("b", 300)]
    assert plan_prefill(0, waiting, budget=512, stall_tokens=None) == [Chunk("a", 500), Chunk("b", 12)]
    assert plan_prefill(100, waiting, budget=512, stall_tokens=None) == [Chunk("a", 412)]
    # the per-sequence chunk limit spreads the room over several prompts, first come first served
    assert plan_prefill(0, waiting, budget=512, stall_tokens=None, chunk_limit=256) == \
        [Chunk("a", 256), Chunk("b", 256)]


def test_the_stall_bound_caps_prefill_but_a_prompt_always_advances():
    waiting = [("a", 1000)]
    assert plan_prefill(8, waiting, budget=8192, stall_tokens=40) == [Chunk("a", 40)]
    assert plan_prefill(8, waiting, budget=8192, stall_tokens=0) == [Chunk("a", MIN_PREFILL_TOKENS)]
    assert plan_prefill(9000, waiting, budget=8192, stall_tokens=None) == [Chunk("a", MIN_PREFILL_TOKENS)]
    assert plan_prefill(0, [], budget=8192, stall_tokens=None) == []


@given(decoding=st.integers(0, 300), budget=st.integers(1, 9000), stall=st.one_of(st.none(), st.integers(0, 5000)),
       limit=st.one_of(st.none(), st.integers(1, 2048)),
       lefts=st.lists(st.integers(1, 5000), min_size=1, max_size=10))
def test_plans_respect_every_bound(decoding, budget, stall, limit, lefts):
    waiting = [(str(i), n) for i, n in enumerate(lefts)]
    chunks = plan_prefill(decoding, waiting, budget, stall, limit)
    room = max(min(budget - decoding, stall if stall is not None else budget), MIN_PREFILL_TOKENS)
    assert chunks and sum(c.tokens for c in chunks) <= room
    assert [c.key for c in chunks] == [str(i) for i in range(len(chunks))]  # in admission order
    for c in chunks:
        assert 0 < c.tokens <= lefts[int(c.key)] and (limit is None or c.tokens <= limit)
    # nobody later gets tokens while an earlier prompt could have taken more
    for c in chunks[:-1]:
        assert c.tokens == min(lefts[int(c.key)], limit or lefts[int(c.key)])


def test_stall_budget_learns_from_measured_steps():
    budget = StallBudget(1.5)
    assert budget.tokens(8) is None  # nothing measured yet
    budget.record(0.100, prefill_tokens=0, decoding=8)
    assert budget.tokens(8) is None  # no prefill measured yet
    budget.record(0.150, prefill_tokens=50, decoding=8)  # 1 ms a prompt token beside the decodes
    assert budget.tokens(8) == 50  # keeps a mixed step within 1.5 x 100 ms
    assert budget.tokens(0) is None  # nothing decodes: nothing to stall
    assert StallBudget(None).tokens(8) is None
