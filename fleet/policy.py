"""Where a request should go: prefix affinity first, load when the affinity target is saturated.

Pure (no Ray), so the decision can be tested without a cluster; fleet/router.py feeds it
replica loads and the prefix hashes each replica holds, and turns its answer into Serve's ranks.

The rule, and why:
- Score each replica by how many leading blocks of the prompt it holds (`matched`). Restoring a
  cached prefix makes prefill up to ~15x cheaper (platform notes), so the deepest match wins.
- Among equally deep matches, the least loaded wins: after a hot prefix has spread, its copies
  share the load.
- The winner is skipped when it is saturated: its load is at least `saturation` AND exceeds the
  least loaded replica's by more than `imbalance`. Then the request takes the power-of-two-choices
  pick among the other replicas, which thereby gets the prefix too (the router remembers where it
  sent it), so a hot prefix spreads to a second replica instead of queueing behind one.
- Without any match (new prefix, short prompt): power of two choices on load, as Serve's default.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Container, Sequence


@dataclass(frozen=True)
class PolicyParams:
    saturation: int = 4  # in-flight requests at which an affinity target may be skipped
    imbalance: int = 2  # ... if it also has this many more than the least loaded replica

    def __post_init__(self) -> None:
        if self.saturation < 1 or self.imbalance < 0:
            raise ValueError("saturation must be >= 1 and imbalance >= 0")


@dataclass(frozen=True)
class ReplicaView:
    key: str  # the replica's id
    load: int  # requests in flight there
    matched: int  # leading prompt blocks it holds


@dataclass(frozen=True)
class Decision:
    ranks: tuple[tuple[str, ...], ...]  # most preferred first; Serve takes the least loaded of a rank
    reason: str  # "affinity", "spill" or "balance" (metrics and tests)


def matched_blocks(prompt_hashes: Sequence[str], *held: Container[str]) -> int:
    """Leading blocks of the prompt found in any of `held` (what a replica reported, what the
    router remembers sending it). The chain makes presence monotone along a prompt (holding block k
    means holding the prefix through k), so stop at the first miss."""
    n = 0
    for h in prompt_hashes:
        if not any(h in blocks for blocks in held):
            break
        n += 1
    return n


def two_choices(views: Sequence[ReplicaView], rng: random.Random) -> tuple[str, ...]:
    """Two random replicas, less loaded first (Serve then probes and picks the lower queue)."""
    if len(views) <= 2:
        picked = list(views)
        rng.shuffle(picked)
    else:
        picked = rng.sample(list(views), 2)
    picked.sort(key=lambda v: v.load)
    return tuple(v.key for v in picked)


def decide(views: Sequence[ReplicaView], params: PolicyParams, rng: random.Random) -> Decision:
    if not views:
        return Decision((), "balance")
    best = max(v.matched for v in views)
    if best == 0:
        return Decision((two_choices(views, rng),), "balance")
    holders = [v for v in views if v.matched == best]
    target = min(holders, key=lambda v: (v.load, rng.random()))
    least = min(v.load for v in views)
    others = [v for v in views if v.key != target.key]
    saturated = target.load >= params.saturation and target.load - least > params.imbalance
    if saturated and others:
        return Decision((two_choices(others, rng), (target.key,)), "spill")
    rest = (two_choices(others, rng),) if others else ()
    return Decision(((target.key,),) + rest, "affinity")
