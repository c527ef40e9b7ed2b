"""What the SSD tier costs a conversation (issue 31), against Pomona on the default serve_config.yaml
(SSD tier on, a fresh `ssd_dir` under --out), started here like benchmarks/harness/side_by_side.py starts it.

    python -m benchmarks.engine.ssd_growth                               # the default model, this machine
    python -m benchmarks.engine.ssd_growth --model /tmp/models/smollm2 --json /tmp/ssd.json   # the device shape
    python -m benchmarks.engine.ssd_growth --base-url http://127.0.0.1:8000/v1 --model DIR     # a running server

growth: one conversation growing by ~`--grow` tokens a turn (a user message of grow - max_tokens tokens,
then the reply of `--max-tokens`, greedy, held at length with `ignore_eos`) for `--turns` turns, the
first turn `--first` tokens. After each turn `POST /admin/cache/flush` (queued SSD writes on disk),
then `ssd.bytes` from its answer (the same stats as `GET /admin/cache`), less what the tier held before
turn 1 (the readiness probe's short entry). Ratio: those bytes / the
conversation's KV size, (last prompt + its output tokens) x KV bytes per token, where KV bytes per
token = layers x kv_heads x head_dim x 2 (K and V) x dtype bytes from the model's config.json (dtype:
float32 when MLX here runs on the CPU, as Pomona loads it there; else the config's `torch_dtype`;
`--kv-dtype` overrides). Goal: <= 1.5 after the last turn. Each turn re-sends the server's own reply,
as a client does (`--fixed-replies`: a fixed text of max_tokens tokens instead).

gaps: `--streams` requests decode (short prompts, up to `--stream-tokens` tokens each) while one
`--long`-token prompt (capped to the context) is sent and finishes; the chunk gaps of the decoding
streams (client side, between SSE chunks carrying text) in three windows: before the long request
(baseline, `--baseline-s`), while it is prefilled and answered (prefill), and after it finished, when
its KV is offered to the tiers and written (persist: `--persist-s` seconds, then `POST
/admin/cache/flush`, and the window ends when the flush returns, so it holds the whole write; the flush
itself asks the MLX thread twice, for the store and for the stats). Reported: p50, p99, max per window
and each window's p99 and max over the baseline's p50. Nothing else polls the server meanwhile.

A `--base-url` server should start with an empty SSD tier (what it holds before turn 1 is subtracted).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx

from benchmarks.harness.client import EndpointConfig, percentile, sse_json, stream_chat, wait_serving
from benchmarks.harness.workloads import TextMaker

GOAL_RATIO = 1.5
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
PARTS = ("growth", "gaps")


# ----------------------------------------------------------------------------------------------
# The model's KV size


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int:
    """K and V of one token over all layers: layers x kv_heads x head_dim x 2 x dtype bytes."""
    text = config.get("text_config") or config  # multimodal configs nest the language model's
    heads = text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    return int(text["num_hidden_layers"]) * int(kv_heads) * int(head_dim) * 2 * int(dtype_bytes)


def kv_dtype(config: dict[str, Any], requested: str = "auto") -> str:
    """The KV cache's dtype as Pomona serves this model here (engine.dtype null): float32 on the CPU,
    else the checkpoint's (`torch_dtype`, bfloat16 if it names none)."""
    if requested != "auto":
        return requested
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return "float32"
    return str(config.get("torch_dtype") or "bfloat16")


def model_config_dir(model: str) -> Path:
    """The directory holding config.json and tokenizer.json for `model` ("default" or a directory)."""
    if model == "default":
        from modelio.models import resolve_model

        return Path(resolve_model("default"))
    return Path(model)


# ----------------------------------------------------------------------------------------------
# Admin calls


def _headers() -> dict[str, str]:
    key = os.environ.get("POMONA_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _root(base_url: str) -> str:
    return base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url


def ssd_stats(answer: dict[str, Any]) -> dict[str, Any]:
    """`ssd` of the first replica's cache stats in a /admin/cache (or flush) answer; {} if none."""
    data = answer.get("data") or []
    if not data:
        return {}
    return dict(((data[0].get("cache") or {}).get("ssd")) or {})


async def admin(client: httpx.AsyncClient, base_url: str, method: str, path: str) -> dict[str, Any]:
    resp = await client.request(method, f"{_root(base_url)}{path}", headers=_headers(), timeout=120.0)
    resp.raise_for_status()
    return resp.json()


# ----------------------------------------------------------------------------------------------
# growth


async def growth(cfg: EndpointConfig, maker: TextMaker, kv_per_token: int, turns: int, first: int, grow: int,
                 max_tokens: int, fixed_replies: bool, seed: int = 0,
                 transport: httpx.AsyncBaseTransport | None = None) -> dict[str, Any]:
    rng = random.Random(seed)
    messages: list[dict[str, str]] = []
    rows: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), trust_env=False, transport=transport) as client:
        before = ssd_stats(await admin(client, cfg.base_url, "GET", "/admin/cache"))
        base = int(before.get("bytes") or 0)  # the readiness probe's entry: not this conversation's
        if base > 1e6:
            print(f"  note: the SSD tier already holds {_mb(base)} before turn 1 (subtracted)", flush=True)
        for turn in range(1, turns + 1):
            user_tokens = max(1, (first if turn == 1 else grow) - max_tokens)
            messages.append({"role": "user", "content": maker.text(user_tokens, rng)})
            r = await stream_chat(client, cfg, list(messages), max_tokens, turn=turn)
            if not r.ok:
                rows.append({"turn": turn, "ok": False, "error": r.error})
                print(f"  growth turn {turn}: ERROR {r.error}", flush=True)
                break
            reply = maker.text(max_tokens, rng) if fixed_replies else r.text
            messages.append({"role": "assistant", "content": reply})
            t0 = time.perf_counter()
            ssd = ssd_stats(await admin(client, cfg.base_url, "POST", "/admin/cache/flush"))
            flush_s = time.perf_counter() - t0
            tokens = (r.prompt_tokens or 0) + r.output_tokens
            kv = tokens * kv_per_token
            ssd_bytes = None if ssd.get("bytes") is None else ssd["bytes"] - base
            row = {"turn": turn, "ok": True, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                   "cached_tokens": r.cached_tokens, "ttft_ms": r.ttft * 1000, "e2e_ms": r.e2e * 1000,
                   "conversation_tokens": tokens, "kv_bytes": kv, "ssd_bytes": ssd_bytes,
                   "ssd_bytes_raw": ssd.get("bytes"),
                   "ssd_keys": ssd.get("keys"), "ssd_queued_after_flush": ssd.get("queued"), "flush_s": flush_s,
                   "ratio": ssd_bytes / kv if ssd_bytes is not None and kv else None, "ssd": ssd}
            rows.append(row)
            ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}"
            print(f"  growth turn {turn}: prompt {r.prompt_tokens} (cached {r.cached_tokens}), out {r.output_tokens}, "
                  f"TTFT {r.ttft * 1000:.0f} ms; conversation {tokens} tokens = KV {kv / 1e6:.1f} MB; "
                  f"ssd.bytes {_mb(ssd_bytes)} (keys {ssd.get('keys')}, flush {flush_s:.2f} s); "
                  f"ssd / KV {ratio}", flush=True)
    done = [r for r in rows if r.get("ok")]
    final = done[-1] if done and len(done) == turns else None
    return {"turns": rows, "ssd_before": before, "kv_bytes_per_token": kv_per_token,
            "final_ratio": final["ratio"] if final else None,
            "final_conversation_tokens": final["conversation_tokens"] if final else None,
            "final_ssd_bytes": final["ssd_bytes"] if final else None, "goal": f"<= {GOAL_RATIO}"}


def _mb(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 1e6:.1f} MB"


# ----------------------------------------------------------------------------------------------
# gaps


@dataclass
class Stream:
    stamps: list[float] = field(default_factory=list)  # perf_counter of each chunk that carries text
    ended: float | None = None  # the stream finished (all its tokens) before it was cancelled
    error: str | None = None


async def decode_stream(client: httpx.AsyncClient, cfg: EndpointConfig, prompt: str, max_tokens: int,
                        out: Stream) -> None:
    """One streaming chat completion, recording when each chunk with text arrives; ends when the
    server ends it or when cancelled (the connection closes, so the server drops the request)."""
    body = {"model": cfg.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, **cfg.extra_body}
    try:
        async with client.stream("POST", f"{cfg.base_url}/chat/completions", json=body, headers=_headers()) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return
            async for chunk in sse_json(resp):
                if any(((c.get("delta") or {}).get("content") for c in chunk.get("choices") or [])):
                    out.stamps.append(time.perf_counter())
        out.ended = time.perf_counter()
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported, never a crash
        out.error = f"{type(exc).__name__}: {exc}"


def window_stats(streams: Sequence[Stream], start: float, end: float) -> dict[str, Any]:
    """Gaps between consecutive chunks of each stream whose later chunk falls in [start, end), in ms."""
    gaps = [(b - a) * 1000 for s in streams for a, b in zip(s.stamps, s.stamps[1:]) if start <= b < end]
    if not gaps:
        return {"chunks": 0, "seconds": end - start}
    return {"chunks": len(gaps), "seconds": end - start, "p50_ms": statistics.median(gaps),
            "p99_ms": percentile(gaps, 99), "max_ms": max(gaps), "mean_ms": sum(gaps) / len(gaps)}


def gap_summary(streams: Sequence[Stream], marks: dict[str, float]) -> dict[str, Any]:
    """Per window (baseline, prefill, persist, all) the gap statistics, and p99 / max over baseline p50."""
    windows = {"baseline": (marks["baseline"], marks["long_sent"]), "prefill": (marks["long_sent"], marks["long_done"]),
               "persist": (marks["long_done"], marks["flushed"]), "all": (marks["baseline"], marks["flushed"])}
    out: dict[str, Any] = {name: window_stats(streams, a, b) for name, (a, b) in windows.items()}
    base = out["baseline"].get("p50_ms")
    for name in ("prefill", "persist", "all"):
        w = out[name]
        if base and w.get("chunks"):
            w["p99_over_baseline_p50"] = w["p99_ms"] / base
            w["max_over_baseline_p50"] = w["max_ms"] / base
    return out


async def gaps(cfg: EndpointConfig, maker: TextMaker, context: int, streams_n: int, stream_tokens: int,
               long_tokens: int, baseline_s: float, persist_s: float, seed: int = 1) -> dict[str, Any]:
    rng = random.Random(seed)
    long_tokens = min(long_tokens, context - 256)  # the template's tokens and the reply must fit
    stream_tokens = min(stream_tokens, context - 256)
    prompts = [maker.text(64, rng) for _ in range(streams_n)]
    long_prompt = maker.text(long_tokens, rng)
    streams = [Stream() for _ in prompts]
    limits = httpx.Limits(max_connections=streams_n + 4, max_keepalive_connections=streams_n + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits, trust_env=False) as client:
        tasks = [asyncio.create_task(decode_stream(client, cfg, p, stream_tokens, s)) for p, s in zip(prompts, streams)]
        try:
            deadline = time.perf_counter() + 300
            while not all(s.stamps or s.error or s.ended for s in streams):
                if time.perf_counter() > deadline:
                    raise TimeoutError("the decoding streams did not start within 300 s")
                await asyncio.sleep(0.05)
            if any(s.error for s in streams):
                raise RuntimeError(f"a decoding stream failed: {[s.error for s in streams if s.error]}")
            marks = {"baseline": time.perf_counter()}
            await asyncio.sleep(baseline_s)
            marks["long_sent"] = time.perf_counter()
            long = await stream_chat(client, cfg, [{"role": "user", "content": long_prompt}], 8)
            marks["long_done"] = time.perf_counter()
            await asyncio.sleep(persist_s)
            marks["flush_sent"] = time.perf_counter()
            ssd = ssd_stats(await admin(client, cfg.base_url, "POST", "/admin/cache/flush"))
            marks["flushed"] = time.perf_counter()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    if not long.ok:
        raise RuntimeError(f"the long request failed: {long.error}")
    summary = gap_summary(streams, marks)
    early = [i for i, s in enumerate(streams) if s.ended is not None and s.ended < marks["flushed"]]
    return {"streams": streams_n, "stream_tokens": stream_tokens, "long_tokens_requested": long_tokens,
            "long_prompt_tokens": long.prompt_tokens, "long_cached_tokens": long.cached_tokens,
            "long_ttft_ms": long.ttft * 1000, "long_e2e_ms": long.e2e * 1000, "baseline_s": baseline_s,
            "persist_s": persist_s, "flush_s": marks["flushed"] - marks["flush_sent"],
            "persist_window_s": marks["flushed"] - marks["long_done"], "windows": summary, "ssd_after_flush": ssd,
            "streams_ended_before_window_end": early,
            "stream_errors": [s.error for s in streams if s.error]}


def print_gaps(g: dict[str, Any]) -> None:
    print(f"  gaps: {g['streams']} streams decoding while a {g['long_prompt_tokens']}-token prompt "
          f"(TTFT {g['long_ttft_ms']:.0f} ms, e2e {g['long_e2e_ms']:.0f} ms) was sent and finished; "
          f"the flush {g['persist_s']:.0f} s after it took {g['flush_s']:.2f} s; SSD then "
          f"{_mb(g['ssd_after_flush'].get('bytes'))}, queued {g['ssd_after_flush'].get('queued')}", flush=True)
    for name, w in g["windows"].items():
        if not w.get("chunks"):
            print(f"    {name:8s}: no chunks", flush=True)
            continue
        rel = (f"; p99 / baseline p50 {w['p99_over_baseline_p50']:.2f}, max / baseline p50 "
               f"{w['max_over_baseline_p50']:.2f}") if "p99_over_baseline_p50" in w else ""
        print(f"    {name:8s}: {w['chunks']} gaps over {w['seconds']:.1f} s: p50 {w['p50_ms']:.1f} ms, "
              f"p99 {w['p99_ms']:.1f} ms, max {w['max_ms']:.1f} ms{rel}", flush=True)
    if g["streams_ended_before_window_end"]:
        print(f"    note: streams {g['streams_ended_before_window_end']} ended before the window did "
              f"(raise --stream-tokens)", flush=True)


# ----------------------------------------------------------------------------------------------
# main


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="'default' (the served default model) or an mlx-lm directory")
    p.add_argument("--base-url", default=None, help="a running Pomona (e.g. http://127.0.0.1:8000/v1); "
                   "default: start one on the default serve_config.yaml with a fresh ssd_dir under --out")
    p.add_argument("--parts", default=",".join(PARTS), help="comma list of: growth, gaps")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--first", type=int, default=500, help="tokens of turn 1 (user message + reply)")
    p.add_argument("--grow", type=int, default=250, help="tokens each later turn adds (user message + reply)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--fixed-replies", action="store_true", help="re-send a fixed text, not the server's reply")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", *DTYPE_BYTES],
                   help="the KV dtype for the KV size (auto: float32 on the CPU, else the config's torch_dtype)")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=4000, help="max_tokens of each decoding stream "
                   "(they are cancelled after the persist window)")
    p.add_argument("--long", type=int, default=15000, help="tokens of the long prompt (capped to context - 256)")
    p.add_argument("--baseline-s", type=float, default=3.0, help="seconds of decoding measured before the long turn")
    p.add_argument("--persist-s", type=float, default=5.0,
                   help="seconds after the long turn finished before the flush that ends the persist window")
    p.add_argument("--port", type=int, default=18160)
    p.add_argument("--out", default=f"benchmarks/results/ssd-growth-{time.strftime('%Y%m%d-%H%M%S')}",
                   help="run directory (server logs, its SSD dir, results.json)")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def measure(args: argparse.Namespace, cfg: EndpointConfig, config_dir: Path,
            save: Callable[[dict[str, Any]], None] = lambda data: None) -> dict[str, Any]:
    """Both parts against `cfg`; `save(data)` after each (an interrupted run keeps what it measured)."""
    config = json.loads((config_dir / "config.json").read_text())
    dtype = kv_dtype(config, args.kv_dtype)
    per_token = kv_bytes_per_token(config, DTYPE_BYTES[dtype])
    text = config.get("text_config") or config
    context = int(text.get("max_position_embeddings") or 4096)
    maker = TextMaker(config_dir)
    data: dict[str, Any] = {"model": args.model, "config_dir": str(config_dir), "kv_dtype": dtype,
                            "kv_bytes_per_token": per_token, "context": context, "base_url": cfg.base_url}
    print(f"KV: {per_token:,} bytes per token ({dtype}); context {context}", flush=True)
    parts = args.parts.split(",")
    if "growth" in parts:
        data["growth"] = asyncio.run(growth(cfg, maker, per_token, args.turns, args.first, args.grow,
                                            args.max_tokens, args.fixed_replies))
        g = data["growth"]
        verdict = ("not measured" if g["final_ratio"] is None else
                   "met" if g["final_ratio"] <= GOAL_RATIO else "NOT met")
        ratio = "n/a" if g["final_ratio"] is None else f"{g['final_ratio']:.2f}"
        print(f"SSD bytes / final KV size after {args.turns} turns: {ratio} (goal <= {GOAL_RATIO}: {verdict}; "
              f"{_mb(g['final_ssd_bytes'])} for {g['final_conversation_tokens']} tokens)", flush=True)
        save(data)
    if "gaps" in parts:
        data["gaps"] = asyncio.run(gaps(cfg, maker, context, args.streams, args.stream_tokens, args.long,
                                        args.baseline_s, args.persist_s))
        print_gaps(data["gaps"])
        save(data)
    return data


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.harness.serve_bench import write_json

    args = _parse(argv)
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; known: {PARTS}")
    out = Path(args.out).resolve()
    config_dir = model_config_dir(args.model)
    command = "python -m benchmarks.engine.ssd_growth " + " ".join(argv if argv is not None else sys.argv[1:])

    def save(data: dict[str, Any]) -> None:
        data["command"] = command.strip()
        for path in (out / "results.json", *([Path(args.json)] if args.json else [])):
            write_json(path, data)
    if args.base_url:
        cfg = EndpointConfig(args.base_url, _served_name(args.base_url, args.model), {"ignore_eos": True})
        data = measure(args, cfg, config_dir, save)
    else:
        import shutil

        from benchmarks.harness.pomona_server import pomona_server
        from benchmarks.harness.servers import available, launched

        shutil.rmtree(out / "pomona-ssd-cache", ignore_errors=True)  # the SSD dir generated_config puts there
        # "default" stays "default" in the config (the served default model, as a new user runs it).
        spec = pomona_server(Path(args.model), args.port, out, {"ignore_eos": True}, name="pomona")
        why = available(spec)
        if why:
            raise SystemExit(f"pomona cannot start here: {why}")
        print(f"[pomona] starting: {spec.command_text}", flush=True)
        with launched(spec, out / "logs") as running:
            cfg = EndpointConfig(spec.base_url, _served_name(spec.base_url, spec.model_name), spec.extra_body)
            ready_s = running.up_s + asyncio.run(wait_serving(cfg, spec.ready_timeout_s))
            print(f"[pomona] serving after {ready_s:.1f} s", flush=True)
            extra = {"server_command": spec.command_text, "ready_s": ready_s}
            data = measure(args, cfg, config_dir, lambda d: save({**d, **extra}))
            data.update(extra)
    save(data)
    print(f"results: {out / 'results.json'}", flush=True)
    return 0


def _served_name(base_url: str, fallback: str) -> str:
    with contextlib.suppress(Exception):
        return httpx.get(f"{base_url}/models", timeout=10, trust_env=False, headers=_headers()).json()["data"][0]["id"]
    return fallback


if __name__ == "__main__":
    raise SystemExit(main())
