"""Where an agent turn's time goes, in process: the ingress's work (parse the Anthropic body,
render the chat template, tokenize) and the engine's (queue, prefix restore, prefill, first
token), turn by turn over the agent trace, with the default serve_config.yaml engine settings
(SSD tier on, a fresh directory). Set beside the HTTP run's TTFT (benchmarks/agent/agent_session.py),
the rest is the serving stack (Ray Serve, the engine process's socket, SSE).

    python -m benchmarks.agent.agent_breakdown MODEL_DIR [--turns 10] [--passes 2] [--no-ssd] [--engine K=V ...]

Prints one line per turn and a JSON summary on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _settings(pairs: list[str]) -> dict[str, Any]:
    import yaml

    return {k: yaml.safe_load(v) for k, v in (p.split("=", 1) for p in pairs)}


async def _started(config: Any, process: bool) -> tuple[Any, Any]:
    """The engine (in process, or in its own process as the server runs it: no Ray, no HTTP), ready,
    and the model's tokenizer."""
    if process:
        from deployments.engine_process import EngineProcess
        from modelio.models import tokenizer_for

        engine: Any = EngineProcess(config)
        await engine.wait_ready(600)
        return engine, tokenizer_for(config.model)
    from engine.loop import AsyncEngine

    engine = AsyncEngine(config)
    await engine.wait_ready(600)
    return engine, engine.tokenizer


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    from api.anthropic.request import parse_messages_request
    from api.core.fields import Limits
    from api.output.tool_syntax import render_prompt, syntax_for
    from benchmarks.agent.agent_session import token_counter
    from benchmarks.agent.agent_trace import anthropic_body, build_trace
    from benchmarks.engine.engine_loop import engine_config
    from engine.types import Request, SamplingParams

    _, count = token_counter(Path(args.model))
    trace = build_trace(count, args.turns)
    ssd = None if args.no_ssd else tempfile.mkdtemp(prefix="pomona-breakdown-")
    config = engine_config(args.model, None, ssd, overrides=_settings(args.engine))
    engine, tok = await _started(config, args.process)
    syntax = syntax_for(tok)
    rows = []
    for turn, salt in [(t, str(p)) for p in range(args.passes) for t in range(1, trace.turns + 1)]:
        body = anthropic_body(trace, turn, "m", 32)
        t0 = time.perf_counter()
        conv = parse_messages_request(body, Limits(), 4096)
        t1 = time.perf_counter()
        text = render_prompt(tok, conv.messages, conv.tools, syntax, dict(conv.chat_template_kwargs))
        t2 = time.perf_counter()
        tokens = tok.encode(text, add_special_tokens=False)
        t3 = time.perf_counter()
        req = Request(tuple(tokens), SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
                      request_id=f"turn-{turn}-{salt}", cache_salt=salt)
        first = end = None
        usage = None
        async for batch in engine.stream(req):
            now = time.perf_counter()
            if first is None and any(e.token_id is not None for e in batch):
                first = now
            for e in batch:
                if e.finished:
                    usage = e.usage
            end = now
        stats = engine.stats()
        row = {"turn": turn, "pass": int(salt), "prompt": len(tokens), "cached": usage.cached_tokens if usage else None,
               "parse_ms": 1e3 * (t1 - t0), "render_ms": 1e3 * (t2 - t1), "tokenize_ms": 1e3 * (t3 - t2),
               "engine_ttft_ms": 1e3 * ((first or t3) - t3), "engine_e2e_ms": 1e3 * ((end or t3) - t3)}
        rows.append(row)
        print(f"pass {salt} turn {turn}: prompt {row['prompt']}, cached {row['cached']}: parse {row['parse_ms']:.1f} ms, "
              f"render {row['render_ms']:.1f} ms, tokenize {row['tokenize_ms']:.1f} ms, engine TTFT "
              f"{row['engine_ttft_ms']:.1f} ms, e2e {row['engine_e2e_ms']:.1f} ms", flush=True)
        await asyncio.sleep(args.gap)
    runner = stats.get("runner", {})
    await engine.shutdown()
    keys = ("parse_ms", "render_ms", "tokenize_ms", "engine_ttft_ms")
    later = {p: [r for r in rows if r["pass"] == p and r["turn"] > 1] for p in range(args.passes)}
    return {"turns": rows, "runner": runner,
            "later_median": {p: {k: statistics.median(r[k] for r in rs) for k in keys} for p, rs in later.items() if rs}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--no-ssd", action="store_true")
    p.add_argument("--process", action="store_true",
                   help="the engine in its own process (deployments/engine_process.py), as the server runs it")
    p.add_argument("--gap", type=float, default=0.3, help="seconds between turns (the SSD writer runs meanwhile)")
    p.add_argument("--passes", type=int, default=2,
                   help="the session again under another cache salt (cold prefix cache, shapes seen before: "
                        "what a pass costs the first time and what it costs again)")
    p.add_argument("--engine", nargs="*", default=[], help="engine settings K=V (YAML values)")
    args = p.parse_args()
    print(json.dumps(asyncio.run(_main(args))))


if __name__ == "__main__":
    from benchmarks.harness.servers import ensure_blas

    ensure_blas()  # as the servers run: Debian's OpenBLAS preloaded (MLX's bundled BLAS is ~15x slower here)
    main()
