"""Prefix-cache-affinity request router for the LLM server (Ray Serve's public RequestRouter API).

Each LLMServer replica reports, through `record_routing_stats`, the block hashes of the prefixes
its prefix cache holds (fleet/keys.py). For every request this router hashes the
prompt's leading token blocks the same way (the ingress tokenizes, so the token ids are the first
argument of `LLMServer.generate`) and lets fleet/policy.py pick: deepest match, unless
that replica is saturated, else power of two choices on load.

Two kinds of knowledge, because the reports lag (one `request_routing_stats_period_s`):
- reported hashes: what each replica really holds (also drops what it evicted);
- remembered hashes: what this router sent where recently, so a burst of requests sharing a new
  prefix follows the first one before any report mentions it.
Load is the larger of this router's own in-flight count and Serve's queue-length cache (which
also sees requests from other ingress replicas).

Not FIFOMixin: its routing tasks may hand the chosen replica to an older queued request, which
would break affinity; without it Serve fulfils exactly the request the choice was made for.
"""

from __future__ import annotations

import collections
import logging
import random
import time
from typing import Any, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from fleet.keys import prefix_hashes, prompt_tokens_of
from fleet.policy import PolicyParams, ReplicaView, decide, matched_blocks

log = logging.getLogger("pomona.router")

DEFAULT_BLOCK_SIZE = 64  # engine.cache.block_size's default; replaced by what replicas report
REMEMBERED_PER_REPLICA = 4096  # hashes this router remembers sending to each replica
MAX_PENDING = 10_000  # requests chosen for but not yet routed (bounds memory if callbacks are lost)
SUSPECT_S = 15.0  # a replica that could not be reached is avoided this long (its node may be gone)


CHANNEL_METHOD = "channel"  # LLMServer.channel: an ingress's step channel to one named replica


def pinned(candidates: list[RunningReplica], pending: Optional[PendingRequest]) -> list[list[RunningReplica]] | None:
    """The answer every router gives first: none without candidates, and a step-channel call to the
    replica it names (deployments/channels.py); None when the router's own policy decides. When the
    named replica is gone, any replica will do: it answers that it is not the one named."""
    if not candidates:
        return []
    if pending is None or pending.metadata.call_method != CHANNEL_METHOD:
        return None
    want = pending.kwargs.get("replica")
    chosen = [r for r in candidates if r.replica_id.unique_id == want]
    return [chosen] if chosen else [candidates[:1]]


class LoadRouter(RequestRouter):
    """Serve's default policy (power of two choices; the base class probes queue lengths and takes
    the shorter), plus the step-channel pinning that Serve's own router cannot do."""

    def initialize_state(self, seed: int | None = None, **_: Any) -> None:
        self._rng = random.Random(seed)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        if (answer := pinned(candidate_replicas, pending_request)) is not None:
            return answer
        return [self._rng.sample(candidate_replicas, min(2, len(candidate_replicas)))]


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, saturation: int = 4, imbalance: int = 2, block_size: int = DEFAULT_BLOCK_SIZE,
                         seed: int | None = None, **_: Any) -> None:
        """Called by Serve with `request_router_kwargs` (serve_config: `fleet.router_kwargs`)."""
        self._params = PolicyParams(saturation=int(saturation), imbalance=int(imbalance))
        self._default_block_size = int(block_size)
        self._rng = random.Random(seed)
        self._inflight: collections.Counter[ReplicaID] = collections.Counter()
        self._remembered: dict[ReplicaID, collections.OrderedDict[str, None]] = {}
        self._reported: dict[ReplicaID, tuple[list[str], frozenset[str]]] = {}  # (the report, its set)
        self._pending: dict[str, list[str]] = {}  # internal request id -> prompt hashes
        self._suspect: dict[ReplicaID, float] = {}  # replica -> monotonic time until it is trusted again
        self.decisions: collections.Counter[str] = collections.Counter()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        if (answer := pinned(candidate_replicas, pending_request)) is not None:
            return answer
        candidate_replicas = self._reachable(candidate_replicas)
        if pending_request is not None and pending_request.metadata.call_method != "generate":
            # Control calls (readiness, stats, the /admin fan-out) go to a random replica: by load
            # they would always reach the idlest one, and /admin would never hear from a busy one.
            order = list(candidate_replicas)
            self._rng.shuffle(order)
            return [[r] for r in order]
        hashes = self._prompt_hashes(candidate_replicas, pending_request)
        views = [ReplicaView(r.replica_id.unique_id, self._load(r), self._matched(r, hashes))
                 for r in candidate_replicas]
        decision = decide(views, self._params, self._rng)
        self.decisions[decision.reason] += 1
        by_key = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_key[k] for k in rank] for rank in decision.ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._inflight[replica_id] += 1
        hashes = self._pending.pop(pending_request.metadata.internal_request_id, None)
        if hashes:
            remembered = self._remembered.setdefault(replica_id, collections.OrderedDict())
            for h in hashes:
                remembered[h] = None
                remembered.move_to_end(h)
            while len(remembered) > REMEMBERED_PER_REPLICA:
                remembered.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._pending.pop(internal_request_id, None)
        if self._inflight[replica_id] > 0:
            self._inflight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        # Its cache died with it: forget it so nothing is routed there for affinity's sake.
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def on_replica_actor_unavailable(self, replica_id: ReplicaID) -> None:
        # Unreachable (its host may have died; Ray reports the death later): avoid it meanwhile,
        # or affinity would keep sending its prefixes, and the ingress's one retry, to it.
        super().on_replica_actor_unavailable(replica_id)
        self._suspect[replica_id] = time.monotonic() + SUSPECT_S
        self._remembered.pop(replica_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for replica_id in set(self._remembered) | set(self._reported) | set(self._inflight):
            if replica_id not in live:
                self._forget(replica_id)

    # -- helpers ---------------------------------------------------------------------------------
    def _reachable(self, replicas: list[RunningReplica]) -> list[RunningReplica]:
        """Replicas not recently unreachable; all of them when every one is (better than none)."""
        now = time.monotonic()
        self._suspect = {k: until for k, until in self._suspect.items() if until > now}
        trusted = [r for r in replicas if r.replica_id not in self._suspect]
        return trusted or replicas

    def _prompt_hashes(self, replicas: list[RunningReplica], pending: Optional[PendingRequest]) -> list[str]:
        if pending is None:
            return []
        tokens = prompt_tokens_of(pending.args, pending.kwargs)
        if not tokens:
            return []
        hashes = prefix_hashes(tokens, self._block_size(replicas))
        if hashes and len(self._pending) < MAX_PENDING:
            self._pending[pending.metadata.internal_request_id] = hashes
        return hashes

    def _block_size(self, replicas: list[RunningReplica]) -> int:
        for r in replicas:
            size = (r.routing_stats or {}).get("block_size")
            if size:
                return int(size)
        return self._default_block_size

    def _matched(self, replica: RunningReplica, hashes: list[str]) -> int:
        if not hashes:
            return 0
        return matched_blocks(hashes, self._reported_set(replica), self._remembered.get(replica.replica_id, {}))

    def _reported_set(self, replica: RunningReplica) -> frozenset[str]:
        blocks = (replica.routing_stats or {}).get("prefix_blocks") or []
        cached = self._reported.get(replica.replica_id)
        if cached is None or cached[0] is not blocks:  # rebuild only when a new report arrived
            cached = (blocks, frozenset(blocks))
            self._reported[replica.replica_id] = cached
        return cached[1]

    def _load(self, replica: RunningReplica) -> int:
        queued = self.replica_queue_len_cache.get(replica.replica_id)
        return max(self._inflight[replica.replica_id], queued or 0)

    def _forget(self, replica_id: ReplicaID) -> None:
        self._remembered.pop(replica_id, None)
        self._reported.pop(replica_id, None)
        self._inflight.pop(replica_id, None)
        self._suspect.pop(replica_id, None)
