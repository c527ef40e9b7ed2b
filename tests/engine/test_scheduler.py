"""The admission policy, with no model at all."""

from __future__ import annotations

import pytest

from cache_tiers.store import Match
from engine.config import EngineConfig
from engine.scheduler import BatchView, Scheduler
from engine.types import OverloadedError, Request, SamplingParams


def req(n: int, rid: str, priority: int = 0, t: float = 0.0) -> Request:
    return Request(tuple(range(1, n + 1)), request_id=rid, priority=priority, arrival_time=t)


def ids(out) -> list[str]:
    return [a.request.request_id for a in out.admit]


def held(lengths: dict[tuple[int, ...], int], key: slice = slice(None)):
    """A prefix store's `find` over {prompt start: cached tokens}, counting its calls."""
    def find(tokens: tuple[int, ...], salt: str = "") -> Match | None:
        find.calls.append(tokens)
        n = lengths.get(tokens[key], 0)
        return Match(n, "ram") if n else None
    find.calls = []
    return find


def test_fcfs_order_and_running_cap():
    s = Scheduler(EngineConfig(max_running=2, prefill_batch=2))
    for i in range(4):
        s.add_request(req(10, f"r{i}", t=i))
    assert ids(s.schedule(BatchView())) == ["r0", "r1"]
    assert ids(s.schedule(BatchView(running=2))) == []
    assert ids(s.schedule(BatchView(running=1))) == ["r2"]


def test_priority_policy_runs_lower_values_first():
    s = Scheduler(EngineConfig(policy="priority", prefill_batch=1))
    s.add_request(req(10, "late", priority=5, t=0))
    s.add_request(req(10, "urgent", priority=-1, t=1))
    s.add_request(req(10, "normal", priority=0, t=2))
    order = [ids(s.schedule(BatchView()))[0] for _ in range(3)]
    assert order == ["urgent", "normal", "late"]


def test_fcfs_ignores_priority():
    s = Scheduler(EngineConfig(prefill_batch=1))
    s.add_request(req(10, "first", priority=9, t=0))
    s.add_request(req(10, "second", priority=-9, t=1))
    assert ids(s.schedule(BatchView())) == ["first"]


def test_bounded_queue_rejects_with_overload():
    s = Scheduler(EngineConfig(max_waiting=2))
    s.add_request(req(5, "a"))
    s.add_request(req(5, "b"))
    with pytest.raises(OverloadedError) as err:
        s.add_request(req(5, "c"))
    assert "capacity" in str(err.value) and err.value.retry_after_s > 0


def test_token_budget_admits_one_oversized_prompt_alone():
    s = Scheduler(EngineConfig(max_batch_tokens=100, prefill_chunk=1000))
    s.add_request(req(150, "big", t=0))
    s.add_request(req(60, "small", t=1))
    assert ids(s.schedule(BatchView())) == ["big"]
    view = BatchView(running=1, prefilling=1, prefill_tokens_left=150, prefill_min_left=150, prefill_max_left=150)
    assert ids(s.schedule(view)) == []
    assert ids(s.schedule(BatchView(running=1))) == ["small"]


def test_length_grouping_keeps_short_prompt_out_of_padded_prefill():
    s = Scheduler(EngineConfig(prefill_chunk=256, max_batch_tokens=10_000))
    s.add_request(req(300, "long-ish", t=0))
    s.add_request(req(20, "short", t=1))
    assert ids(s.schedule(BatchView())) == ["long-ish"]
    # 300 tokens left (> one chunk): the short one would be padded to 256 and waits instead.
    view = BatchView(running=1, prefilling=1, prefill_tokens_left=300, prefill_min_left=300, prefill_max_left=300)
    assert ids(s.schedule(view)) == []


def test_short_prompt_joins_a_very_long_prefill():
    # Waiting for 4,000 tokens of prefill would cost far more than one padded chunk.
    s = Scheduler(EngineConfig(prefill_chunk=256, max_batch_tokens=10_000))
    s.add_request(req(20, "short"))
    view = BatchView(running=1, prefilling=1, prefill_tokens_left=4000, prefill_min_left=4000,
                     prefill_max_left=4000)
    assert ids(s.schedule(view)) == ["short"]


def test_finished_waiting_request_is_never_admitted():
    s = Scheduler(EngineConfig())
    s.add_request(req(5, "gone", t=0))
    s.add_request(req(5, "kept", t=1))
    assert [r.request_id for r in s.finish_requests({"gone"})] == ["gone"]
    assert len(s) == 1
    assert ids(s.schedule(BatchView())) == ["kept"]


def test_duplicate_id_refused():
    s = Scheduler(EngineConfig())
    s.add_request(req(5, "x"))
    with pytest.raises(ValueError):
        s.add_request(req(5, "x"))


def test_memory_account_keeps_request_waiting_until_it_fits():
    s = Scheduler(EngineConfig())
    s.add_request(Request((1,) * 50, SamplingParams(max_tokens=50), request_id="a", arrival_time=0))
    s.add_request(Request((1,) * 50, SamplingParams(max_tokens=50), request_id="b", arrival_time=1))
    # 150 tokens of KV free: the first (100) fits, the second does not while the first runs
    assert ids(s.schedule(BatchView(kv_tokens_free=150))) == ["a"]
    assert ids(s.schedule(BatchView(running=1, kv_tokens_free=50))) == []
    # with nothing running, one request always starts (it could never start otherwise)
    assert ids(s.schedule(BatchView(running=0, kv_tokens_free=10))) == ["b"]


def test_grouping_off_lets_short_prompt_join_padded_prefill():
    s = Scheduler(EngineConfig(prefill_chunk=256, prefill_group_ratio=None))
    s.add_request(req(20, "short"))
    view = BatchView(running=1, prefilling=1, prefill_tokens_left=300, prefill_min_left=300, prefill_max_left=300)
    assert ids(s.schedule(view)) == ["short"]


def test_auto_grouping_only_on_cpu():
    assert Scheduler(EngineConfig(), on_cpu=True).group_ratio == 2.0
    assert Scheduler(EngineConfig(), on_cpu=False).group_ratio is None


def test_prompt_sharing_a_prefix_in_prefill_waits_for_its_cache_others_go_ahead():
    s = Scheduler(EngineConfig(prefill_chunk=4096, max_batch_tokens=100_000))
    shared = tuple(range(1, 201))
    s.add_request(Request(shared + (7, 8), request_id="sibling", arrival_time=0))
    s.add_request(Request(tuple(range(500, 700)), request_id="unrelated", arrival_time=1))
    view = BatchView(running=1, prefilling=1, prefill_tokens_left=210, prefill_min_left=210,
                     prefill_max_left=210, prefilling_prompts=(shared + (9,),), share_tokens=64)
    assert ids(s.schedule(view)) == ["unrelated"]
    assert len(s) == 1
    # once that prefill is over (its prefix cached), the sibling starts
    assert ids(s.schedule(BatchView(running=2, share_tokens=64))) == ["sibling"]


def test_siblings_arriving_together_are_not_prefilled_twice():
    s = Scheduler(EngineConfig(prefill_chunk=4096, max_batch_tokens=100_000))
    shared = tuple(range(1, 201))
    s.add_request(Request(shared + (1,), request_id="first", arrival_time=0))
    s.add_request(Request(shared + (2,), request_id="second", arrival_time=1))
    assert ids(s.schedule(BatchView(share_tokens=64))) == ["first"]
    assert ids(s.schedule(BatchView(share_tokens=None))) == ["second"]  # no cache: nothing to wait for


def test_siblings_whose_prefix_is_already_cached_start_together():
    s = Scheduler(EngineConfig(prefill_chunk=4096, max_batch_tokens=100_000))
    shared = tuple(range(1, 201))
    for i in range(3):
        s.add_request(Request(shared + (i, i), request_id=f"hit{i}", arrival_time=i))
    find = held({shared: 180}, slice(0, 200))  # the cache holds 180 of the 200 shared tokens
    view = BatchView(share_tokens=64)
    assert ids(s.schedule(view, find)) == ["hit0", "hit1", "hit2"]
    s.add_request(Request(tuple(range(300, 500)) + (1,), request_id="cold0", arrival_time=3))
    s.add_request(Request(tuple(range(300, 500)) + (2,), request_id="cold1", arrival_time=4))
    assert ids(s.schedule(view, find)) == ["cold0"]  # nothing of theirs is cached: the second waits


def test_nobody_is_admitted_while_a_prompt_awaits_its_first_token():
    s = Scheduler(EngineConfig())
    s.add_request(req(10, "late"))
    assert ids(s.schedule(BatchView(running=1, first_token_pending=1))) == []
    assert ids(s.schedule(BatchView(running=1))) == ["late"]


def test_first_token_hold_can_be_switched_off():
    s = Scheduler(EngineConfig(first_token_first=False))
    s.add_request(req(10, "late"))
    assert ids(s.schedule(BatchView(running=1, first_token_pending=1))) == ["late"]


def test_first_token_hold_auto_is_on_for_cpu_off_for_gpu():
    for on_cpu, admitted in ((True, []), (False, ["late"])):
        s = Scheduler(EngineConfig(first_token_first="auto"), on_cpu=on_cpu)
        s.add_request(req(10, "late"))
        assert ids(s.schedule(BatchView(running=1, first_token_pending=1))) == admitted
    with pytest.raises(ValueError, match="first_token_first"):
        EngineConfig(first_token_first="sometimes")


def test_long_prompts_prefill_one_after_another_on_cpu():
    s = Scheduler(EngineConfig(prefill_chunk=256, max_batch_tokens=10_000), on_cpu=True)
    for i, name in enumerate(("rag-1", "rag-2")):
        s.add_request(Request(tuple(range(1000, 1558)), request_id=name, arrival_time=float(i)))
    s.add_request(req(40, "short", t=2.0))
    assert ids(s.schedule(BatchView())) == ["rag-1"]
    busy = BatchView(running=1, prefilling=1, prefill_tokens_left=558, prefill_min_left=558, prefill_max_left=558)
    assert ids(s.schedule(busy)) == []  # FCFS: the short one waits behind rag-2, which waits its turn
    assert ids(s.schedule(BatchView(running=1))) == ["rag-2", "short"]


def test_long_prompt_with_a_cached_prefix_still_joins():
    s = Scheduler(EngineConfig(prefill_chunk=256, max_batch_tokens=10_000), on_cpu=True)
    s.add_request(Request(tuple(range(1000, 1558)), request_id="hit"))  # 520 cached, 38 to compute
    view = BatchView(running=1, prefilling=1, prefill_tokens_left=200, prefill_min_left=200, prefill_max_left=200)
    assert ids(s.schedule(view, lambda p, salt="": Match(520, "ram"))) == ["hit"]


def test_long_prompts_batch_together_off_the_cpu():
    s = Scheduler(EngineConfig(prefill_chunk=256, max_batch_tokens=10_000), on_cpu=False)
    for i, name in enumerate(("a", "b")):
        s.add_request(Request(tuple(range(1000, 1558)), request_id=name, arrival_time=float(i)))
    assert ids(s.schedule(BatchView())) == ["a", "b"]


def test_the_plan_carries_each_admission_s_match_and_path_found_once():
    """The store is asked once per request: the plan hands the engine what `find` said, and the
    path it implies (direct: a long cached context with a short rest; else the batched prefill)."""
    s = Scheduler(EngineConfig(prefill_chunk=512, max_batch_tokens=10_000, direct_first_token=64), on_cpu=False)
    follow_up = tuple(range(1000, 1300))  # 280 cached, 20 to compute
    s.add_request(Request(follow_up, request_id="turn2"))
    s.add_request(Request(tuple(range(5000, 5300)), request_id="cold"))  # nothing cached
    s.add_request(Request(tuple(range(2000, 2040)) + tuple(range(7000, 7260)), request_id="system"))  # 40 cached
    find = held({follow_up[:10]: 280, tuple(range(2000, 2010)): 40}, slice(0, 10))
    out = s.schedule(BatchView(), find)
    plan = {a.request.request_id: a for a in out.admit}
    assert plan["turn2"].match == Match(280, "ram") and plan["turn2"].direct
    assert plan["cold"].match is None and not plan["cold"].direct
    assert not plan["system"].direct  # 40 cached of 300: mostly a new prompt, prefilled in the batch
    assert out.direct
    assert sorted(find.calls) == sorted(r.request.prompt_tokens for r in out.admit)  # once each


def test_a_too_short_match_counts_as_no_cached_prefix():
    s = Scheduler(EngineConfig(direct_first_token=64), on_cpu=True)
    s.add_request(Request(tuple(range(1, 40)), request_id="r"))
    [admission] = s.schedule(BatchView(), lambda p, salt="": Match(30, "ram", too_short=True)).admit
    assert admission.match.usable == 0 and not admission.direct


def test_any_rest_goes_direct_when_nobody_runs():
    """An agent's next turn (a long cached context, a tool result longer than the direct limit):
    direct when the batch is idle, since its prefill stalls nobody; batched when others decode."""
    config = EngineConfig(prefill_chunk=256, max_batch_tokens=10_000, direct_first_token=64)
    turn = tuple(range(1000, 1600))  # 450 cached, 150 to compute
    for running, direct in ((0, True), (1, False)):
        s = Scheduler(config, on_cpu=False)
        s.add_request(Request(turn, request_id="turn"))
        [admission] = s.schedule(BatchView(running=running), lambda p, salt="": Match(450, "ram")).admit
        assert admission.direct is direct
    off = Scheduler(EngineConfig(direct_first_token=None), on_cpu=True)
    off.add_request(Request(turn, request_id="turn"))
    assert not off.schedule(BatchView(), lambda p, salt="": Match(450, "ram")).admit[0].direct


def test_a_bounded_kv_cache_reserves_its_window_not_the_whole_request():
    s = Scheduler(EngineConfig())
    for rid, t in (("a", 0), ("b", 1)):
        s.add_request(Request((1,) * 50, SamplingParams(max_tokens=50), request_id=rid, arrival_time=t))
    # rings of 32 positions: each request holds at most 33 (the ring and the token being written)
    assert ids(s.schedule(BatchView(kv_tokens_free=70, kv_window=32))) == ["a", "b"]
    s.add_request(Request((1,) * 50, SamplingParams(max_tokens=50), request_id="c", arrival_time=2))
    assert ids(s.schedule(BatchView(running=2, kv_tokens_free=70))) == []  # unbounded: 100 > 70


def test_a_request_whose_prefix_is_loading_waits_and_the_next_goes_first():
    """`find` answers LOADING while a request's prefix is read from the SSD: it stays queued in its
    place, the requests behind it are admitted meanwhile, and it is admitted once its read is done."""
    from engine.scheduler import LOADING

    s = Scheduler(EngineConfig(max_running=4, prefill_batch=4))
    for i in range(3):
        s.add_request(req(10 + i, f"r{i}", t=i))
    loading = {11}

    def find(tokens: tuple[int, ...], salt: str = "") -> Match | None:
        return LOADING if len(tokens) in loading else None

    assert ids(s.schedule(BatchView(), find)) == ["r0", "r2"]
    assert ids(s.schedule(BatchView(running=2), find)) == []
    loading.clear()
    assert ids(s.schedule(BatchView(running=2), find)) == ["r1"]
    assert len(s) == 0
