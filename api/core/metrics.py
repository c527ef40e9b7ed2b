"""Prometheus metrics of the ingress: its own counters plus the engine's stats, on prometheus_client (no Ray here).

The exposed names are a contract (users' dashboards and the tests read them): `pomona_requests_total`,
`pomona_tokens_total`, ... keep their names, labels and meanings. Each `IngressMetrics` owns its
`CollectorRegistry`: one process may hold several apps (tests, the multi-model front), and the
global default registry would mix their series or refuse the second app's names.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Iterable, Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

log = logging.getLogger("pomona.ingress")

# The hand-written exposition this replaced had no `<name>_created` series; Prometheus does not need
# them and they would double the series count. The switch is process-wide: nothing else in the
# ingress process exports through prometheus_client.
disable_created_metrics()

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_KINDS = ("prompt", "completion", "cached")
# Every route label `pomona_requests_total` may carry: the app's routes (parametrised ones by their
# template) and "other". A raw path as a label would let any client, even an unauthenticated one,
# add series to /metrics and memory to the ingress without bound. tests/api/test_metrics_names.py checks
# that every route of the app is listed here.
ROUTE_LABELS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/openapi.json",
    "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/responses/{response_id}",
    "/v1/responses/{response_id}/input_items", "/admin/requests", "/admin/cache", "/admin/cache/clear",
    "/admin/cache/flush", "/admin/reset", "/admin/models",
})
OTHER = "other"
_TEMPLATES = tuple((re.compile("^" + re.sub(r"\\{[a-z_]+\\}", "[^/]+", re.escape(t)) + "$"), t)
                   for t in sorted(ROUTE_LABELS) if "{" in t)


def route_label(path: str) -> str:
    """The metrics label of a path inside the app (its route_prefix stripped): a known route, its
    template for a parametrised one (`/v1/responses/{response_id}`), else "other"."""
    if path in ROUTE_LABELS and "{" not in path:
        return path
    for pattern, template in _TEMPLATES:
        if pattern.match(path):
            return template
    return OTHER


def request_label(scope: Any) -> str:
    """`route_label` of an ASGI scope (a Starlette request's `.scope`): root_path stripped."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return route_label(path)


class IngressMetrics:
    """The ingress's counters. The ingress is single-threaded asyncio; prometheus_client's own locks
    are not needed for that but cost little next to a request."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Counter names are given without `_total`: prometheus_client appends it to what it exposes.
        self._requests = Counter("pomona_requests", "HTTP requests by route and status", ("route", "status"),
                                 registry=r)
        self._tokens = Counter("pomona_tokens", "Tokens of finished requests by kind", ("kind",), registry=r)
        for kind in TOKEN_KINDS:  # all three kinds are exposed from the start, at 0
            self._tokens.labels(kind=kind)
        self._cached_by_tier = Counter("pomona_cached_tokens", "Prompt tokens served from the prefix cache, by tier",
                                       ("tier",), registry=r)
        self.in_flight = Gauge("pomona_requests_in_flight", "Generation requests being answered", registry=r)
        self.disconnects = Counter("pomona_client_disconnects", "Streams whose client went away before the end",
                                   registry=r)
        self._failovers = Counter("pomona_failover_retries",
                                  "Requests restarted on another replica after theirs went away before the "
                                  "first token", registry=r)
        self.ttft = self._histogram("pomona_time_to_first_token_seconds", "Time to the first token")
        self.itl = self._histogram("pomona_inter_token_latency_seconds", "Time between tokens of a stream")
        self.e2e = self._histogram("pomona_request_duration_seconds", "Time from arrival to the last token")
        self._stats_errors = Counter("pomona_engine_stats_errors", "/metrics scrapes that got no stats from the "
                                     "model server", registry=r)
        self._engine = EngineStatsCollector()
        r.register(self._engine)
        self.engine_stats_ok = True  # a change is logged, not every failed scrape

    def _histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)

    # -- what the request paths report -----------------------------------------------------------
    def count(self, route: str, status: int) -> None:
        """`route` is a label from ROUTE_LABELS; anything else is counted as "other" (never a raw path)."""
        label = route if route in ROUTE_LABELS else OTHER
        self._requests.labels(route=label, status=str(status)).inc()

    def failover(self) -> None:
        self._failovers.inc()

    def inter_token(self, seconds: float, tokens: int) -> None:
        """`tokens` tokens arrived together, `seconds` apart each. One observation per token, so the
        histogram counts tokens (as before); prometheus_client has no weighted observe."""
        for _ in range(tokens):
            self.itl.observe(seconds)

    def usage(self, usage: Mapping[str, Any]) -> None:
        self._tokens.labels(kind="prompt").inc(int(usage.get("prompt_tokens", 0)))
        self._tokens.labels(kind="completion").inc(int(usage.get("completion_tokens", 0)))
        cached = int(usage.get("cached_tokens", 0))
        self._tokens.labels(kind="cached").inc(cached)
        tier = usage.get("cache_tier")
        if tier and cached:
            self._cached_by_tier.labels(tier=str(tier)).inc(cached)

    @property
    def requests(self) -> dict[tuple[str, int], int]:
        """Requests counted so far by (route, status): for tests and callers that want numbers, not text."""
        return {(s.labels["route"], int(s.labels["status"])): int(s.value)
                for family in self._requests.collect() for s in family.samples if s.name.endswith("_total")}

    # -- the engine's stats ----------------------------------------------------------------------
    def engine_stats_failed(self, exc: BaseException) -> None:
        self._stats_errors.inc()
        if self.engine_stats_ok:
            log.warning("/metrics: the model server's stats are unavailable (%s: %s); pomona_engine_up is 0 "
                        "until they come back", type(exc).__name__, exc)
        self.engine_stats_ok = False

    def engine_stats_arrived(self) -> None:
        if not self.engine_stats_ok:
            log.info("/metrics: the model server's stats are back")
        self.engine_stats_ok = True

    def render(self, engine: Mapping[str, Any] | None) -> str:
        """The exposition text, with `engine` (one replica's stats, None when none answered) read at
        this scrape. No await between handing over the stats and generating: no other scrape interleaves."""
        self._engine.stats = engine
        try:
            return generate_latest(self.registry).decode("utf-8")
        finally:
            self._engine.stats = None  # the stats dict is not kept past its scrape


class EngineStatsCollector(Collector):
    """The engine's stats dict as gauges, read at scrape time: its keys may grow without code changes
    here, so nothing is declared ahead. Numbers become `pomona_engine_<key>`, a dict of numbers
    `pomona_engine_<key>{kind}`, the `cache` dict `pomona_cache_<counter>{tier}`; the rest is skipped."""

    def __init__(self) -> None:
        self.stats: Mapping[str, Any] | None = None

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("pomona_engine_up", "1 when a model server replica's stats arrived for this scrape",
                                value=0 if self.stats is None else 1)
        if self.stats is None:
            return
        families: dict[str, GaugeMetricFamily] = {}
        for name, label, labels, value in engine_samples(self.stats):
            if name in RESERVED:  # a stats key must not shadow the ingress's own series
                continue
            if name not in families:
                # Every family declares its one label; an unlabelled sample passes no value for it.
                families[name] = GaugeMetricFamily(name, "Model server stats (one replica)", labels=(label,))
            families[name].add_metric(labels, value)
        yield from families.values()


RESERVED = frozenset({"pomona_engine_up", "pomona_engine_stats_errors_total"})


def engine_samples(stats: Mapping[str, Any]) -> Iterator[tuple[str, str, list[str], float]]:
    """(name, label name, label values, value) for each number in the engine's stats, sorted by key."""
    for key, value in sorted(stats.items()):
        if key == "cache" and isinstance(value, Mapping):
            yield from _cache_samples(value)
        elif isinstance(value, Mapping):
            for sub, v in sorted(value.items()):
                if _is_number(v):
                    yield f"pomona_engine_{_name(key)}", "kind", [str(sub)], float(v)
        elif _is_number(value):
            yield f"pomona_engine_{_name(key)}", "kind", [], float(value)


def _cache_samples(cache: Mapping[str, Any]) -> Iterator[tuple[str, str, list[str], float]]:
    for tier, counters in sorted(cache.items()):
        if isinstance(counters, Mapping):
            for k, v in sorted(counters.items()):
                if _is_number(v):
                    yield f"pomona_cache_{_name(k)}", "tier", [str(tier)], float(v)
        elif _is_number(counters):
            yield f"pomona_cache_{_name(tier)}", "tier", [], float(counters)


def _name(raw: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", raw)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
