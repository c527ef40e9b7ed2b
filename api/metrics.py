"""Prometheus text exposition for the ingress: its own counters plus the engine's stats (no Ray here).

A few dozen lines instead of a client library: the ingress is single-threaded asyncio, so plain dicts
need no locks, and engine stats arrive as a dict whose keys may grow without code changes here.
"""

from __future__ import annotations

import bisect
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

log = logging.getLogger("pomona.ingress")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _name(raw: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", raw)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.total += value * times
        self.n += times

    def render(self, name: str) -> list[str]:
        lines, running = [], 0
        for bound, count in zip(self.buckets, self.counts):
            running += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {running}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        lines += [f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]
        return lines


@dataclass
class IngressMetrics:
    requests: dict[tuple[str, int], int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=lambda: {"prompt": 0, "completion": 0, "cached": 0})
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0
    disconnects: int = 0
    failovers: int = 0  # requests restarted on another replica after theirs went away (fleet_failover)
    engine_stats_errors: int = 0  # /metrics scrapes that got no stats from the model server
    engine_stats_ok: bool = True  # a change is logged, not every failed scrape
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)

    def count(self, route: str, status: int) -> None:
        self.requests[(route, status)] = self.requests.get((route, status), 0) + 1

    def failover(self) -> None:
        self.failovers += 1

    def engine_stats_failed(self, exc: BaseException) -> None:
        self.engine_stats_errors += 1
        if self.engine_stats_ok:
            log.warning("/metrics: the model server's stats are unavailable (%s: %s); pomona_engine_up is 0 "
                        "until they come back", type(exc).__name__, exc)
        self.engine_stats_ok = False

    def engine_stats_arrived(self) -> None:
        if not self.engine_stats_ok:
            log.info("/metrics: the model server's stats are back")
        self.engine_stats_ok = True

    def usage(self, usage: Mapping[str, Any]) -> None:
        self.tokens["prompt"] += int(usage.get("prompt_tokens", 0))
        self.tokens["completion"] += int(usage.get("completion_tokens", 0))
        cached = int(usage.get("cached_tokens", 0))
        self.tokens["cached"] += cached
        tier = usage.get("cache_tier")
        if tier and cached:
            self.cached_by_tier[tier] = self.cached_by_tier.get(tier, 0) + cached

    def render(self, engine: Mapping[str, Any] | None) -> str:
        out = ["# TYPE pomona_requests_total counter"]
        out += [f"pomona_requests_total{_labels({'route': r, 'status': str(s)})} {n}"
                for (r, s), n in sorted(self.requests.items())]
        out.append("# TYPE pomona_tokens_total counter")
        out += [f"pomona_tokens_total{_labels({'kind': k})} {n}" for k, n in sorted(self.tokens.items())]
        out.append("# TYPE pomona_cached_tokens_total counter")
        out += [f"pomona_cached_tokens_total{_labels({'tier': t})} {n}" for t, n in sorted(self.cached_by_tier.items())]
        out += ["# TYPE pomona_requests_in_flight gauge", f"pomona_requests_in_flight {self.in_flight}",
                "# TYPE pomona_client_disconnects_total counter", f"pomona_client_disconnects_total {self.disconnects}",
                "# TYPE pomona_failover_retries_total counter", f"pomona_failover_retries_total {self.failovers}"]
        for name, hist in (("pomona_time_to_first_token_seconds", self.ttft),
                           ("pomona_inter_token_latency_seconds", self.itl),
                           ("pomona_request_duration_seconds", self.e2e)):
            out.append(f"# TYPE {name} histogram")
            out += hist.render(name)
        out += ["# TYPE pomona_engine_stats_errors_total counter",
                f"pomona_engine_stats_errors_total {self.engine_stats_errors}", "# TYPE pomona_engine_up gauge"]
        out += render_engine(engine) if engine is not None else ["pomona_engine_up 0"]
        return "\n".join(out) + "\n"


def render_engine(stats: Mapping[str, Any]) -> list[str]:
    """Flatten the engine's stats: numbers become gauges, `cache` becomes per-tier series."""
    out = ["pomona_engine_up 1"]
    for key, value in sorted(stats.items()):
        if key == "cache" and isinstance(value, Mapping):
            out += _render_cache(value)
        elif isinstance(value, Mapping):
            for sub, v in sorted(value.items()):
                if _is_number(v):
                    out.append(f"pomona_engine_{_name(key)}{_labels({'kind': str(sub)})} {float(v):g}")
        elif _is_number(value):
            out.append(f"pomona_engine_{_name(key)} {float(value):g}")
    return out


def _render_cache(cache: Mapping[str, Any]) -> list[str]:
    out = []
    for tier, counters in sorted(cache.items()):
        if isinstance(counters, Mapping):
            out += [f"pomona_cache_{_name(k)}{_labels({'tier': str(tier)})} {float(v):g}"
                    for k, v in sorted(counters.items()) if _is_number(v)]
        elif _is_number(counters):
            out.append(f"pomona_cache_{_name(tier)} {float(counters):g}")
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
