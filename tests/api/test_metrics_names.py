"""/metrics names are a contract: users' dashboards read them. Every exposed series (name, label
names, type) is pinned here, so a rename, a `_total` added or lost, or a new `_created` series fails."""

from __future__ import annotations

from typing import Any

from backend_fakes import NoReplica
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from api.core.metrics import IngressMetrics
from api.service.server import OpenAIServer
from api.service.settings import AppSettings

HISTOGRAMS = ("pomona_time_to_first_token_seconds", "pomona_inter_token_latency_seconds",
              "pomona_request_duration_seconds")
INGRESS = {
    ("pomona_requests_total", ("route", "status"), "counter"),
    ("pomona_tokens_total", ("kind",), "counter"),
    ("pomona_cached_tokens_total", ("tier",), "counter"),
    ("pomona_requests_in_flight", (), "gauge"),
    ("pomona_client_disconnects_total", (), "counter"),
    ("pomona_failover_retries_total", (), "counter"),
    ("pomona_engine_stats_errors_total", (), "counter"),
    ("pomona_engine_up", (), "gauge"),
    *((f"{h}_bucket", ("le",), "histogram") for h in HISTOGRAMS),
    *((f"{h}_{part}", (), "histogram") for h in HISTOGRAMS for part in ("count", "sum")),
}
ENGINE = {  # the engine's stats dict, flattened: names follow its keys
    ("pomona_engine_running", (), "gauge"),
    ("pomona_engine_waiting", (), "gauge"),
    ("pomona_engine_step_time_ms", (), "gauge"),
    ("pomona_engine_prompt_tokens_total", (), "gauge"),
    ("pomona_engine_requests_finished", ("kind",), "gauge"),
    ("pomona_cache_hits", ("tier",), "gauge"),
    ("pomona_cache_bytes", ("tier",), "gauge"),
    ("pomona_cache_entries", (), "gauge"),
}
STATS = {"ready": True, "model": "m", "running": 2, "waiting": 1, "step_time_ms": 12.5,
         "prompt_tokens_total": 10, "requests_finished": {"stop": 3, "abort": 1},
         "cache": {"ram": {"hits": 5, "bytes": 100}, "ssd": {"hits": 1, "path": "/x"}, "entries": 7}}


def _filled() -> IngressMetrics:
    m = IngressMetrics()
    m.count("/v1/completions", 200)
    m.usage({"prompt_tokens": 4, "completion_tokens": 2, "cached_tokens": 3, "cache_tier": "ram"})
    m.failover()
    m.ttft.observe(0.02)
    m.inter_token(0.01, 3)
    m.e2e.observe(1.5)
    return m


def _series(text: str) -> dict[tuple[str, tuple[str, ...], str], list[Any]]:
    """(sample name, label names, family type) -> the samples; the text must parse as Prometheus text."""
    out: dict[tuple[str, tuple[str, ...], str], list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault((s.name, tuple(sorted(s.labels)), family.type), []).append(s)
    return out


def test_every_series_keeps_its_name_labels_and_type() -> None:
    assert set(_series(_filled().render(STATS))) == INGRESS | ENGINE
    assert set(_series(_filled().render(None))) == INGRESS


def test_values_mean_what_they_meant() -> None:
    series = _series(_filled().render(STATS))
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for group in series.values() for s in group}
    assert value[("pomona_tokens_total", (("kind", "cached"),))] == 3
    assert value[("pomona_cached_tokens_total", (("tier", "ram"),))] == 3
    assert value[("pomona_inter_token_latency_seconds_count", ())] == 3  # counts tokens, not batches
    assert value[("pomona_time_to_first_token_seconds_bucket", (("le", "0.025"),))] == 1
    assert value[("pomona_engine_requests_finished", (("kind", "abort"),))] == 1
    assert value[("pomona_cache_hits", (("tier", "ssd"),))] == 1
    assert value[("pomona_engine_up", ())] == 1 and value[("pomona_failover_retries_total", ())] == 1


def test_apps_in_one_process_keep_their_own_counts() -> None:
    """Each app has its own registry (tests and the multi-model front hold several in one process)."""
    a, b = IngressMetrics(), IngressMetrics()
    a.count("/v1/models", 200)
    assert a.requests == {("/v1/models", 200): 1} and b.requests == {}


def test_the_route_answers_prometheus_text() -> None:
    class Stats(NoReplica):
        async def stats(self) -> dict[str, Any]:
            return STATS

    server = OpenAIServer(AppSettings.from_args({"model": "m"}), Stats(), load_tokenizer=lambda: None)
    with TestClient(server.app()) as client:
        reply = client.get("/metrics")
    assert reply.headers["content-type"].startswith("text/plain; version=")
    assert ENGINE <= set(_series(reply.text))
