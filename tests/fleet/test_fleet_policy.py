"""The fleet's routing decision and hashing, without Ray: affinity, spill when saturated, balance."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fleet.keys import held_hashes, prefix_hashes, prompt_tokens_of
from fleet.policy import PolicyParams, ReplicaView, decide, matched_blocks
from fleet.settings import FleetSettings

PARAMS = PolicyParams(saturation=4, imbalance=2)


def test_router_and_replica_hash_the_same_way():
    prompt = list(range(300))
    held = held_hashes([np.arange(200, dtype=np.int64)], block_size=64)  # a cached entry: numpy ids
    hashes = prefix_hashes(prompt, 64)
    assert len(hashes) == 4 and len(held) == 3
    assert matched_blocks(hashes, set(held)) == 3
    assert prefix_hashes([1] + prompt[1:], 64)[0] != hashes[0]  # the chain covers every earlier token


def test_deepest_match_wins_unless_saturated():
    rng = random.Random(0)
    views = [ReplicaView("a", 1, 3), ReplicaView("b", 0, 1), ReplicaView("c", 0, 0)]
    d = decide(views, PARAMS, rng)
    assert d.reason == "affinity" and d.ranks[0] == ("a",)
    hot = [ReplicaView("a", 6, 3), ReplicaView("b", 0, 0)]
    d = decide(hot, PARAMS, rng)
    assert d.reason == "spill" and d.ranks[0] == ("b",) and d.ranks[1] == ("a",)


def test_a_spread_prefix_goes_to_the_less_loaded_holder():
    views = [ReplicaView("a", 5, 3), ReplicaView("b", 1, 3)]
    assert decide(views, PARAMS, random.Random(0)).ranks[0] == ("b",)


def test_no_match_is_power_of_two_choices():
    views = [ReplicaView(k, load, 0) for k, load in (("a", 3), ("b", 1), ("c", 2))]
    d = decide(views, PARAMS, random.Random(1))
    assert d.reason == "balance" and len(d.ranks[0]) == 2
    loads = {v.key: v.load for v in views}
    assert loads[d.ranks[0][0]] <= loads[d.ranks[0][1]]


def test_prompt_tokens_come_from_generate_args():
    assert prompt_tokens_of([[1, 2, 3], {}, "id"], {}) == [1, 2, 3]
    assert prompt_tokens_of([], {"prompt_tokens": (4, 5)}) == [4, 5]
    assert prompt_tokens_of(["text"], {}) is None


def test_fleet_settings_validate():
    assert FleetSettings.from_dict({"router": "affinity", "min_replicas": 1, "max_replicas": 3}).autoscaling
    with pytest.raises(ValueError):
        FleetSettings.from_dict({"router": "nearest"})
    with pytest.raises(ValueError):
        FleetSettings.from_dict({"min_replicas": 1})
