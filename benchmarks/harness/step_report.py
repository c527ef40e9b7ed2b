"""The engine's step accounting around a load: steps/s, ms per step, tokens per step, MLX thread time.

Pomona's engine counts its steps, tokens and where its MLX thread's time goes (engine/stats.py
`ThreadTimes`). Read before and after one level of a benchmark (in process from `AsyncEngine.stats()`,
over HTTP from /metrics), the difference says whether the same engine steps slower behind Ray Serve
than in a plain process, and whether its thread was working or waiting (for the GIL, or for a GPU
whose driver waits without spinning) when it did:

- `ms_per_step`: wall time of `Engine.step` per step; `step_cpu_ms`: the MLX thread's CPU in it;
- `tokens_per_step` / `prompt_tokens_per_step`: output and prompt tokens per step;
- `deliver_ms_per_step`, `commands_ms_per_step`: handing events to the event loops, taking requests;
- `busy_share`: the thread's accounted time over the level's wall time;
- `engine_ttft_ms` / `engine_queue_ms`: the mean first-token time and queue time the engine counted
  from each request's arrival there (queue, prefix restore, prefill), and over HTTP `ingress_ttft_ms`,
  the ingress's mean from handing the tokens on to the first batch back. Set beside the client's
  mean TTFT they split it as benchmarks/agent/serving_path.py does per turn: engine, hops (ingress
  less engine), front (client less ingress), for every part of a run (prefix, multi-turn, sweep).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import httpx

KINDS = ("commands", "step", "step_cpu", "deliver")
_METRIC = re.compile(r'^pomona_engine_(\w+?)(?:\{kind="(\w+)"\})? ([0-9.eE+-]+)$')
# The ingress's TTFT histogram (api/core/metrics.py), summed over its labels.
_INGRESS = re.compile(r'^pomona_time_to_first_token_seconds_(sum|count)(?:\{[^}]*\})? ([0-9.eE+-]+)$')


def counters(stats: Mapping[str, Any]) -> dict[str, float]:
    """The counters this report reads, from an engine stats dict (`AsyncEngine.stats()`)."""
    times = stats.get("mlx_thread_seconds") or {}
    out = {"steps": float(stats.get("steps", 0)), "tokens": float(stats.get("generation_tokens_total", 0)),
           "prompt_tokens": float(stats.get("prompt_tokens_total", 0)),
           "first_tokens": float(stats.get("first_tokens", 0)), "ttft_s": float(stats.get("ttft_seconds_sum", 0.0)),
           "queue_s": float(stats.get("queue_seconds_sum", 0.0))}
    out.update({k: float(times.get(k, 0.0)) for k in KINDS})
    runner = stats.get("runner") or {}  # the own step's (engine/step/step_runner.py) counters, in process only
    out.update({f"runner_{k}": float(v) for k, v in runner.items() if isinstance(v, (int, float))})
    return out


def from_metrics(text: str) -> dict[str, float] | None:
    """The same counters from a /metrics exposition; None when it has none (not Pomona)."""
    stats: dict[str, Any] = {"mlx_thread_seconds": {}}
    ingress = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        i = _INGRESS.match(line)
        if i:
            ingress[i.group(1)] += float(i.group(2))
            continue
        m = _METRIC.match(line)
        if not m:
            continue
        name, kind, value = m.group(1), m.group(2), float(m.group(3))
        if name == "mlx_thread_seconds" and kind:
            stats["mlx_thread_seconds"][kind] = value
        elif kind is None:
            stats[name] = value
    if "steps" not in stats:
        return None
    return {**counters(stats), "ingress_ttft_s": ingress["sum"], "ingress_first_tokens": ingress["count"]}


def scrape(base_url: str) -> dict[str, float] | None:
    """GET /metrics of the server at `base_url` (…/v1 or its root); None if it has no engine counters."""
    root = base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url
    try:
        resp = httpx.get(f"{root}/metrics", timeout=10, trust_env=False)
    except httpx.HTTPError:
        return None
    return from_metrics(resp.text) if resp.status_code == 200 else None


def report(before: Mapping[str, float] | None, after: Mapping[str, float] | None, wall_s: float) -> dict[str, float] | None:
    if not before or not after:
        return None
    d = {k: after[k] - before[k] for k in after}
    steps = max(d["steps"], 1.0)
    return {"steps": d["steps"], "steps_per_s": round(d["steps"] / wall_s, 2),
            "ms_per_step": round(1000 * d["step"] / steps, 3), "step_cpu_ms": round(1000 * d["step_cpu"] / steps, 3),
            "tokens_per_step": round(d["tokens"] / steps, 2),
            "prompt_tokens_per_step": round(d["prompt_tokens"] / steps, 2),
            "deliver_ms_per_step": round(1000 * d["deliver"] / steps, 3),
            "commands_ms_per_step": round(1000 * d["commands"] / steps, 3),
            "busy_share": round((d["step"] + d["deliver"] + d["commands"]) / wall_s, 3),
            **_first_tokens(d), **_runner(d, after, steps)}


def _first_tokens(d: Mapping[str, float]) -> dict[str, float]:
    """Mean first-token times the engine (and over HTTP the ingress) counted over the level."""
    out = {}
    if d.get("first_tokens", 0) > 0:
        out["engine_ttft_ms"] = round(1000 * d["ttft_s"] / d["first_tokens"], 2)
        out["engine_queue_ms"] = round(1000 * d["queue_s"] / d["first_tokens"], 2)
    if d.get("ingress_first_tokens", 0) > 0:
        out["ingress_ttft_ms"] = round(1000 * d["ingress_ttft_s"] / d["ingress_first_tokens"], 2)
    return out


def _runner(d: Mapping[str, float], after: Mapping[str, float], steps: float) -> dict[str, float]:
    """The own step's split of a step: building it (host), waiting for its tokens, prompt tokens fed."""
    if "runner_build_s" not in d:
        return {}
    return {"prefill_tokens_per_step": round(d["runner_prefill_tokens"] / steps, 2),
            "build_ms_per_step": round(1000 * d["runner_build_s"] / steps, 3),
            "wait_ms_per_step": round(1000 * d["runner_wait_s"] / steps, 3),
            "shapes": after["runner_shapes"], "decode_only_step_ms": after.get("runner_decode_step_ms", 0.0)}
