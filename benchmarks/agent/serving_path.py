"""Where an agent turn's first token goes over HTTP: the client's TTFT split by Pomona's own clocks.

    python -m benchmarks.agent.serving_path MODEL_DIR [--turns 10] [--passes 2] [--out FILE.json]
        [--server pomona-inproc]   # a variant of the harness (the engine inside the replica, ...)

One Pomona server (the default serve_config.yaml, the harness's `pomona` spec), the agent trace's
turns over `POST /v1/messages`, and around each turn a scrape of `/metrics`, whose sums give:
- engine: `pomona_engine_ttft_seconds_sum`, from the engine process's receipt of the request to its
  first token (queue, prefix restore, prefill);
- hops: the ingress's `pomona_time_to_first_token_seconds_sum` (from handing the tokens to the
  model replica to the first batch back) less the engine's: Ray Serve's handle call, the replica,
  the engine process's socket, both ways;
- front: the client's TTFT less the ingress's: the HTTP proxy, reading and parsing the body,
  the chat template, tokenizing, and the first SSE event's way out.
One turn at a time, so each scrape's delta is that turn's. Why: agent_breakdown.py times the engine
in process; this shows what the stack adds to it, turn by turn, without a profiler.
Prints a line per turn and a JSON summary on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import httpx

ENGINE_TTFT = "pomona_engine_ttft_seconds_sum"
INGRESS_TTFT = "pomona_time_to_first_token_seconds_sum"
# The engine process publishes its stats every 0.1 s (deployments/engine_worker.py), not while a long
# prefill holds its loop: wait this long after a turn for its first token to be counted.
STATS_WAIT_S = 0.5


def metric_sums(text: str, names: Sequence[str]) -> dict[str, float]:
    """The sum over labels of each named sample in a Prometheus exposition text (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += float(sample.value)
    return out


def split(client_ttft_s: float, before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """One turn's TTFT in ms: client, engine, hops (ingress less engine), front (client less ingress)."""
    engine = after[ENGINE_TTFT] - before[ENGINE_TTFT]
    ingress = after[INGRESS_TTFT] - before[INGRESS_TTFT]
    return {"client_ms": client_ttft_s * 1e3, "engine_ms": engine * 1e3, "hops_ms": (ingress - engine) * 1e3,
            "front_ms": (client_ttft_s - ingress) * 1e3}


async def _session(base: str, model: str, trace: Any, turns: int, passes: int) -> list[dict[str, Any]]:
    from benchmarks.agent.agent_session import stream_messages
    from benchmarks.agent.agent_trace import anthropic_body

    rows = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), trust_env=False) as client:
        async def scrape() -> dict[str, float]:
            r = await client.get(base.removesuffix("/v1") + "/metrics")
            r.raise_for_status()
            return metric_sums(r.text, (ENGINE_TTFT, INGRESS_TTFT))

        for p in range(passes):
            for turn in range(1, turns + 1):
                # Each pass under its own cache salt: the second sees the engine's shapes warm, not its cache.
                body = anthropic_body(trace, turn, model, 32, {"cache_salt": f"pass-{p}"})
                before = await scrape()
                result = await stream_messages(client, base, body, turn)
                if not result.ok:
                    raise RuntimeError(f"turn {turn}: {result.error}")
                await asyncio.sleep(STATS_WAIT_S)
                row = {"pass": p, "turn": turn, "prompt": result.prompt_tokens, "cached": result.cached_tokens,
                       **split(result.ttft_s, before, await scrape())}
                rows.append(row)
                print(f"pass {p} turn {turn}: prompt {row['prompt']}, cached {row['cached']}: client "
                      f"{row['client_ms']:.1f} ms = engine {row['engine_ms']:.1f} + hops {row['hops_ms']:.1f} "
                      f"+ front {row['front_ms']:.1f}", flush=True)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    later = [r for r in rows if r["turn"] > 1]
    return {key: round(statistics.median(r[key] for r in later), 1) if later else None
            for key in ("client_ms", "engine_ms", "hops_ms", "front_ms")} | {"turns_2_plus": len(later)}


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.agent.agent_session import token_counter
    from benchmarks.agent.agent_trace import build_trace
    from benchmarks.harness.side_by_side import make_spec, serving

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--port", type=int, default=18170)
    p.add_argument("--server", default="pomona", help="the harness's Pomona variant (side_by_side.make_spec)")
    p.add_argument("--out", default=None, help="write the rows and summary here (JSON)")
    args = p.parse_args(argv)
    _, count = token_counter(Path(args.model))
    trace = build_trace(count, args.turns)
    run_dir = Path(tempfile.mkdtemp(prefix="pomona-serving-path-"))
    with serving(make_spec(args.server, Path(args.model), args.port, run_dir), run_dir) as (_, cfg, ready_s):
        print(f"[{args.server}] serving after {ready_s:.1f} s", flush=True)
        rows = asyncio.run(_session(cfg.base_url, cfg.model, trace, trace.turns, args.passes))
    out = {"rows": rows, "median_turns_2_plus": summary(rows)}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out["median_turns_2_plus"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
