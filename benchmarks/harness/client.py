"""Async streaming client for any OpenAI-compatible endpoint, with `vllm bench serve`-style metrics.

One `Conversation` is a list of user turns sent in order; each turn after the first carries the
previous turns and the assistant's replies, so single-turn workloads are conversations of one turn.
Timing is taken on the client, from just before the request is sent to each SSE chunk that carries
text, so every server is measured the same way regardless of what it reports about itself.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

import httpx


@dataclass(frozen=True)
class Conversation:
    """User turns of one chat; `system` (if any) is a shared prefix such as a system prompt."""

    turns: tuple[str, ...]
    max_tokens: int
    system: str | None = None
    conv_id: int = 0
    group: int = 0  # prefix group for the prefix-repetition workload


@dataclass(frozen=True)
class RequestResult:
    ok: bool
    conv_id: int
    turn: int
    start: float  # monotonic seconds at send
    ttft: float = 0.0
    e2e: float = 0.0
    itl: tuple[float, ...] = ()
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    usage_reported: bool = False
    retries: int = 0
    text: str = ""
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, as vLLM defines it."""
        if self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class EndpointConfig:
    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str
    # Per-server extras so output lengths stay fixed: `{"ignore_eos": True}` where supported,
    # `{"logit_bias": {eos: -100}}` where only that is (mlx_lm.server). Everything else is shared.
    extra_body: dict[str, Any] = field(default_factory=dict)
    temperature: float = 0.0
    timeout_s: float = 600.0


def _request_body(cfg: EndpointConfig, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(cfg.extra_body)
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    parts = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        parts.append(delta.get("content") or delta.get("reasoning") or choice.get("text") or "")
    return "".join(parts)


@dataclass
class _StreamState:
    """Mutable accumulator while one response streams; frozen into a RequestResult at the end."""

    t0: float
    first: float | None = None
    last: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    text: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    retries: int = 0

    def on_chunk(self, chunk: dict[str, Any], now: float) -> None:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        piece = _chunk_text(chunk)
        if not piece:
            return
        if self.first is None:
            self.first = now
        else:
            self.itl.append(now - (self.last or now))
        self.last = now
        self.chunks += 1
        self.text.append(piece)


def _finish(state: _StreamState, conv_id: int, turn: int, end: float) -> RequestResult:
    usage = state.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    completion = usage.get("completion_tokens")
    return RequestResult(
        ok=True, conv_id=conv_id, turn=turn, start=state.t0,
        ttft=(state.first or end) - state.t0, e2e=end - state.t0, itl=tuple(state.itl),
        # Servers may merge several tokens into one chunk; usage is exact when it is reported.
        output_tokens=int(completion) if completion is not None else state.chunks,
        prompt_tokens=usage.get("prompt_tokens"), cached_tokens=details.get("cached_tokens"),
        usage_reported=completion is not None, retries=state.retries, text="".join(state.text),
    )


class _NotAccepted(Exception):
    """The connection failed before any response header: the server never took the request."""



async def sse_json(resp: Any) -> AsyncIterator[dict]:
    """The JSON payloads of an OpenAI-style server-sent event stream, up to its `[DONE]`."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)

async def _stream_once(client: httpx.AsyncClient, cfg: EndpointConfig, body: dict[str, Any],
                       state: _StreamState) -> None:
    try:
        cm = client.stream("POST", f"{cfg.base_url}/chat/completions", json=body, timeout=cfg.timeout_s)
        resp = await cm.__aenter__()
    except httpx.TransportError as exc:
        raise _NotAccepted(f"{type(exc).__name__}: {exc}") from exc
    try:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode(errors="replace")[:300]
            raise RuntimeError(f"HTTP {resp.status_code}: {detail}")
        async for chunk in sse_json(resp):
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            state.on_chunk(chunk, time.perf_counter())
    finally:
        await cm.__aexit__(None, None, None)


async def stream_chat(client: httpx.AsyncClient, cfg: EndpointConfig, messages: list[dict[str, str]],
                      max_tokens: int, conv_id: int = 0, turn: int = 0) -> RequestResult:
    """Send one streaming chat completion and time it; failures come back as `ok=False`.

    A connection refused or reset before any response header is retried (up to 3 attempts) with
    the clock still running: servers with a small listen backlog (mlx_lm.server's is 5) drop
    connections in a burst of 32, and a real client would reconnect. Retries are counted."""
    body = _request_body(cfg, messages, max_tokens)
    state = _StreamState(t0=time.perf_counter())
    for attempt in range(3):
        try:
            await _stream_once(client, cfg, body, state)
            break
        except _NotAccepted as exc:
            state.retries += 1
            if attempt == 2:
                return _failed(state, conv_id, turn, str(exc))
            await asyncio.sleep(0.05 * (attempt + 1))
        except Exception as exc:  # noqa: BLE001 - every failure is a counted error, never a crash
            return _failed(state, conv_id, turn, f"{type(exc).__name__}: {exc}")
    return _finish(state, conv_id, turn, time.perf_counter())


def _failed(state: _StreamState, conv_id: int, turn: int, error: str) -> RequestResult:
    return RequestResult(ok=False, conv_id=conv_id, turn=turn, start=state.t0,
                         e2e=time.perf_counter() - state.t0, retries=state.retries, error=error)


async def run_conversation(client: httpx.AsyncClient, cfg: EndpointConfig,
                           conv: Conversation) -> list[RequestResult]:
    """Turns in order; each turn's prompt is the whole conversation so far plus the new message."""
    messages: list[dict[str, str]] = []
    if conv.system:
        messages.append({"role": "system", "content": conv.system})
    results = []
    for turn, user in enumerate(conv.turns):
        messages.append({"role": "user", "content": user})
        result = await stream_chat(client, cfg, list(messages), conv.max_tokens, conv.conv_id, turn)
        results.append(result)
        if not result.ok:
            break  # later turns would not be the same workload without this reply
        messages.append({"role": "assistant", "content": result.text})
    return results


def _client(concurrency: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(limits=limits, timeout=None, trust_env=False)


async def run_closed_loop(cfg: EndpointConfig, convs: Sequence[Conversation], concurrency: int,
                          on_done: Callable[[int], None] | None = None) -> tuple[list[RequestResult], float]:
    """At most `concurrency` conversations in flight; returns results and wall-clock duration."""
    sem = asyncio.Semaphore(concurrency)
    async with _client(concurrency) as client:
        async def one(conv: Conversation) -> list[RequestResult]:
            async with sem:
                res = await run_conversation(client, cfg, conv)
            if on_done:
                on_done(len(res))
            return res

        t0 = time.perf_counter()
        batches = await asyncio.gather(*(one(c) for c in convs))
        duration = time.perf_counter() - t0
    return [r for b in batches for r in b], duration


async def run_poisson(cfg: EndpointConfig, convs: Sequence[Conversation], rate: float, seed: int = 0,
                      max_concurrency: int | None = None,
                      on_done: Callable[[int], None] | None = None) -> tuple[list[RequestResult], float]:
    """Open loop: conversations start at Poisson arrivals of `rate` per second (inf = all at once)."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency or len(convs) or 1)
    async with _client(max_concurrency or len(convs)) as client:
        async def one(conv: Conversation, delay: float) -> list[RequestResult]:
            await asyncio.sleep(delay)
            async with sem:
                res = await run_conversation(client, cfg, conv)
            if on_done:
                on_done(len(res))
            return res

        delays, t = [], 0.0
        for _ in convs:
            delays.append(t)
            t += rng.expovariate(rate) if rate != float("inf") else 0.0
        t0 = time.perf_counter()
        batches = await asyncio.gather(*(one(c, d) for c, d in zip(convs, delays)))
        duration = time.perf_counter() - t0
    return [r for b in batches for r in b], duration


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) without importing numpy."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _summary(values: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    """mean/p50/p95/p99 in milliseconds (scale) like vllm bench serve."""
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p95": float("nan"), "p99": float("nan")}
    return {
        "mean": sum(values) / len(values) * scale,
        "p50": percentile(values, 50) * scale,
        "p95": percentile(values, 95) * scale,
        "p99": percentile(values, 99) * scale,
    }


def aggregate(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """Request/token throughput and latency distributions over the successful requests."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    turns = sorted({r.turn for r in ok})
    return {
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_samples": [r.error for r in results if not r.ok][:3],
        "connect_retries": sum(r.retries for r in results),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": prompt_tokens,
        "usage_reported_share": sum(r.usage_reported for r in ok) / len(ok) if ok else 0.0,
        "cached_tokens": cached,
        "cached_token_share": cached / prompt_tokens if prompt_tokens else 0.0,
        "ttft_ms": _summary([r.ttft for r in ok]),
        "tpot_ms": _summary([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _summary([x for r in ok for x in r.itl]),
        "e2e_ms": _summary([r.e2e for r in ok]),
        "ttft_p50_ms_by_turn": {str(t): percentile([r.ttft for r in ok if r.turn == t], 50) * 1000
                                for t in turns},
    }


async def wait_ready(base_url: str, timeout_s: float = 300.0,
                     alive: Callable[[], bool] | None = None) -> float:
    """Poll until `GET /health` or `GET {base_url}/models` answers 200; returns seconds waited.

    Both, because mlx_lm.server's /v1/models fails without a Hugging Face cache directory while
    other servers have no /health."""
    t0 = time.perf_counter()
    root = base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        while time.perf_counter() - t0 < timeout_s:
            if alive is not None and not alive():
                raise RuntimeError("server process exited before it became ready")
            for url in (f"{root}/health", f"{base_url}/models"):
                try:
                    if (await client.get(url)).status_code == 200:
                        return time.perf_counter() - t0
                except httpx.HTTPError:
                    pass
            await asyncio.sleep(1.0)
    raise TimeoutError(f"{base_url} not ready after {timeout_s:.0f} s")



async def wait_serving(cfg: EndpointConfig, timeout_s: float = 600.0,
                       alive: Callable[[], bool] | None = None) -> float:
    """Send a one-token completion until one succeeds: an answering /models (or /health) does not
    mean the model is loaded (Pomona's ingress answers before its engine replica is ready)."""
    t0 = time.perf_counter()
    last = ""
    async with _client(1) as client:
        while time.perf_counter() - t0 < timeout_s:
            if alive is not None and not alive():
                raise RuntimeError("server process exited before it could serve")
            result = await stream_chat(client, cfg, [{"role": "user", "content": "ready?"}], 1)
            if result.ok:
                return time.perf_counter() - t0
            last = result.error or ""
            await asyncio.sleep(1.0)
    raise TimeoutError(f"{cfg.base_url} did not serve a completion in {timeout_s:.0f} s: {last}")
