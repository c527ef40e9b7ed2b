"""Capacity of Pomona's token path through Ray Serve, with no model: items/s and tokens/s over HTTP.

A replica runs the real `EngineHost` (its pacing included) over `SyntheticEngine`, which gives
every running request one token each `--step-ms`. An ingress replica reads it through the real
`HandleBackend` (a streaming `DeploymentHandle`, failover wrapper included) and writes SSE with the
real `sse_events`/`SSEResponse`; N clients read that over loopback HTTP through Serve's proxy.

    python -m benchmarks.device.token_path                              # pacing off and on, 1-128 streams
    python -m benchmarks.device.token_path --pacing 0,1000 --streams 1,8,32,128 --step-ms 5 --tokens 256

Per row: the path (`--channel 0`: each request's own Ray stream carries its tokens; 1: the step channels of
deployments/channels.py, one Ray item per step from the replica, SSE writes paced in the ingress),
streams, the budget (`stream_items_per_s`, 0 = one item per step per request),
items/s and tokens/s received by all clients together, tokens per item, what the synthetic engine
would allow (streams / step), and each client's gap between items (p50, p90) in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import httpx

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def build_app(step_s: float, items_per_s: float, channel: bool = False) -> Any:
    """The probe's Serve application: ProbeReplica (engine side) behind ProbeIngress (HTTP side)."""
    from ray import serve
    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest
    from starlette.routing import Route

    from deployments.engine_host import EngineHost, StreamPacing
    from deployments.ingress import HandleBackend
    from api.core.metrics import IngressMetrics
    from api.core.streaming import SSEResponse, Tracker, sse_events
    from engine.config import EngineConfig

    from benchmarks.device.token_path_engine import SyntheticEngine

    from ray.serve.config import RequestRouterConfig

    from fleet.options import LOAD_ROUTER_CLASS

    @serve.deployment(name="ProbeReplica", max_ongoing_requests=1000,
                      request_router_config=RequestRouterConfig(request_router_class=LOAD_ROUTER_CLASS))
    class ProbeReplica:
        def __init__(self) -> None:
            self._host = EngineHost(EngineConfig(), engine_factory=lambda _: SyntheticEngine(step_s),
                                    pacing=StreamPacing(items_per_s),
                                    replica_key=serve.get_replica_context().replica_id.unique_id)

        async def generate(self, prompt_tokens: list[int], params: dict[str, Any], request_id: str,
                           channel: str | None = None):
            async for item in self._host.stream(prompt_tokens, params, request_id, channel):
                yield item

        async def channel(self, key: str, replica: str):
            async for item in self._host.channel(key, replica):
                yield item

    def render(text: str, lps: list, finish: str | None, offset: int) -> list[dict[str, Any]]:
        return [{"choices": [{"delta": {"content": text}, "finish_reason": finish}]}]

    @serve.deployment(name="ProbeIngress", max_ongoing_requests=2000)
    @serve.ingress()
    class ProbeIngress:
        def __init__(self, replica: Any) -> None:
            self._backend = HandleBackend(replica, step_channels=channel, pacing=StreamPacing(items_per_s))
            self._metrics = IngressMetrics()
            self._count = 0

        async def stream(self, request: HttpRequest) -> SSEResponse:
            body = await request.json()
            self._count += 1
            stream = self._backend.stream([1], {"max_tokens": int(body["tokens"])}, f"p{self._count}")
            first = await stream.__anext__()
            tracker = Tracker(self._metrics, time.monotonic())
            return SSEResponse(sse_events(first, stream, tracker, render, None, []),
                               on_close=stream.aclose)

        def __serve_build_asgi_app__(self) -> Starlette:
            return Starlette(routes=[Route("/stream", self.stream, methods=["POST"])])

    return ProbeIngress.bind(ProbeReplica.bind())


async def _one(client: httpx.AsyncClient, url: str, tokens: int) -> tuple[int, int, list[float]]:
    """One stream: (items, tokens, gaps between items in s)."""
    items = got = 0
    gaps: list[float] = []
    last = None
    async with client.stream("POST", url, json={"tokens": tokens}) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            text = json.loads(line[6:])["choices"][0]["delta"]["content"]
            items += 1
            got += text.count(" tok")
            if last is not None:
                gaps.append(now - last)
            last = now
    return items, got, gaps


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def sweep_once(url: str, streams: int, tokens: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as client:
        await _one(client, url, 4)  # warm the connection path
        t0 = time.perf_counter()
        results = await asyncio.gather(*[_one(client, url, tokens) for _ in range(streams)])
        wall = time.perf_counter() - t0
    items = sum(r[0] for r in results)
    got = sum(r[1] for r in results)
    gaps = [g for r in results for g in r[2]]
    return {"streams": streams, "wall_s": round(wall, 3), "items": items, "tokens": got,
            "items_per_s": round(items / wall, 1), "tokens_per_s": round(got / wall, 1),
            "tokens_per_item": round(got / max(items, 1), 2), "gap_ms_p50": round(1000 * _pct(gaps, 0.5), 2),
            "gap_ms_p90": round(1000 * _pct(gaps, 0.9), 2), "complete": got == streams * tokens}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, configure_logging=False, log_to_driver=False,
             object_store_memory=200 * 2**20,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": os.pathsep.join(
                 [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}})
    rows: list[dict[str, Any]] = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        url = f"http://127.0.0.1:{args.port}/probe/stream"
        modes = [(channel, float(b)) for channel in (int(c) for c in args.channel.split(","))
                 for b in args.pacing.split(",")]
        for channel, budget in modes:
            serve.run(build_app(args.step_ms / 1000, budget, bool(channel)), name="probe", route_prefix="/probe")
            for n in (int(s) for s in args.streams.split(",")):
                row = {"channel": channel, "items_per_s_budget": budget, "step_ms": args.step_ms,
                       "engine_tokens_per_s": round(n / (args.step_ms / 1000), 1),
                       **asyncio.run(sweep_once(url, n, args.tokens))}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    head = ("| path | streams | budget items/s | items/s | tokens/s | engine allows tok/s | tokens/item | "
            "gap p50 ms | gap p90 ms |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    lines = [f"| {'step channel' if r.get('channel') else 'per request'} | {r['streams']} | {r['items_per_s_budget']:.0f} | {r['items_per_s']:,.0f} | {r['tokens_per_s']:,.0f} "
             f"| {r['engine_tokens_per_s']:,.0f} | {r['tokens_per_item']:.1f} | {r['gap_ms_p50']:.1f} "
             f"| {r['gap_ms_p90']:.1f} |" for r in rows]
    return "\n".join([head, *lines])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pacing", default="0,1000", help="replica budgets, items/s (0: one item per step)")
    p.add_argument("--streams", default="1,8,32,128")
    p.add_argument("--channel", default="0,1", help="0: one Ray stream per request; 1: step channels")
    p.add_argument("--step-ms", type=float, default=5.0, help="the synthetic engine's step")
    p.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    p.add_argument("--num-cpus", type=int, default=os.cpu_count() or 2)
    p.add_argument("--port", type=int, default=18431)
    p.add_argument("--json", default=None, help="write the rows here (default: $OUT/token_path.json if set)")
    args = p.parse_args(argv)
    rows = run(args)
    out = args.json or (os.path.join(os.environ["OUT"], "token_path.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
