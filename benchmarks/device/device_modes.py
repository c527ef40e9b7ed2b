"""The device benchmark's three modes: the raw decode step, the bare `BatchGenerator` loop and
Pomona's engine (see `benchmarks/device/device_bench.py`). mlx-lm is used through its public API only."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import threading
import time
from typing import Any

import mlx.core as mx

from benchmarks.device.device_models import CONTEXT, Workload, engine_detokenizer_class
from benchmarks.device.device_profile import StepRecorder, TimedModel, generator_profile, pc, recording, timed, timers


def _generator(model: Any, n: int, cfg: argparse.Namespace) -> Any:
    from mlx_lm.generate import BatchGenerator

    return BatchGenerator(model, stop_tokens=None, completion_batch_size=n,
                          prefill_batch_size=min(cfg.prefill_batch, n), prefill_step_size=cfg.prefill_chunk)


# -- (a) the raw step ---------------------------------------------------------------------------
def prefilled_batch(model: Any, wl: Workload, cfg: argparse.Namespace) -> tuple[Any, list, mx.array]:
    """Let a `BatchGenerator` prefill every prompt (its batches, chunks and padding), then take each
    sequence's cache out (`extract_cache`) and merge them into one batch cache. Returns the
    generator, the batch cache and the next inputs (each sequence's latest token)."""
    n = len(wl.prompts)
    gen = _generator(model, n, cfg)
    uids = gen.insert([list(p) for p in wl.prompts], max_tokens=[10**6] * n)
    ended: set[int] = set()
    last: dict[int, int] = {}
    while len(ended) < n or len(last) < n:  # every prompt done and one decode step for each
        prompt_responses, generated = gen.next()
        ended.update(r.uid for r in prompt_responses if r.end_of_prompt)
        last.update((r.uid, r.token) for r in generated)
    extracted = gen.extract_cache(uids)
    per_seq = [extracted[u][0] for u in uids]
    cache = [type(layers[0]).merge(list(layers)) for layers in zip(*per_seq)]
    y = mx.array([last[u] for u in uids], dtype=mx.uint32)
    gen.remove(uids)
    mx.eval(y, [c.state for c in cache])
    return gen, cache, y


def _forward(model: Any, cache: list, tokens: mx.array, variant: str) -> tuple[mx.array, Any]:
    logits = model(tokens[:, None], cache=cache)[:, -1, :]
    if variant == "raw":
        return mx.argmax(logits, axis=-1), None
    if variant == "pipelined":
        return mx.argmax(logits, axis=-1), []
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # as GenerationBatch does
    return mx.argmax(logprobs, axis=-1), list(logprobs)


def _sync_steps(model: Any, cache: list, y: mx.array, total: int, warm: int) -> tuple[list, float, float, int]:
    build = wait = 0.0
    times = []
    for i in range(total):
        t0 = pc()
        y, _ = _forward(model, cache, y, "raw")
        t1 = pc()
        mx.eval(y)
        t2 = pc()
        if i >= warm:
            build, wait = build + t1 - t0, wait + t2 - t1
            times.append(t2 - t0)
    return times, build, wait, total


def _pipelined_steps(model: Any, cache: list, y: mx.array, variant: str, total: int,
                     warm: int) -> tuple[list, float, float, int]:
    """`BatchGenerator`'s double buffering: launch step t+1, then wait for step t."""
    build = wait = 0.0
    times = []
    nxt, nxt_lp = _forward(model, cache, y, variant)
    mx.async_eval(nxt, nxt_lp)
    for i in range(total):
        t0 = pc()
        cur, cur_lp = nxt, nxt_lp
        nxt, nxt_lp = _forward(model, cache, cur, variant)
        t1 = pc()
        mx.async_eval(nxt, nxt_lp)
        mx.eval(cur, cur_lp)
        cur.tolist()
        t2 = pc()
        if i >= warm:
            build, wait = build + t1 - t0, wait + t2 - t1
            times.append(t2 - t0)
    mx.eval(nxt, nxt_lp)
    return times, build, wait, total + 1


def raw_steps(model: Any, cache: list, y: mx.array, variant: str, steps: int, warm: int) -> dict:
    """Time `steps` decode steps (after `warm` untimed ones), then trim the cache back."""
    if variant == "raw":
        times, build, wait, total = _sync_steps(model, cache, y, warm + steps, warm)
    else:
        times, build, wait, total = _pipelined_steps(model, cache, y, variant, warm + steps, warm)
    for c in cache:
        c.trim(total)
    ms = statistics.fmean(times) * 1e3
    return {"variant": variant, "steps": steps, "ms_per_step": ms, "median_ms": statistics.median(times) * 1e3,
            "tokens_per_s": y.shape[0] * 1e3 / ms, "graph_build_ms": build / steps * 1e3,
            "launch_and_wait_ms": wait / steps * 1e3}


def run_raw(model: Any, wl: Workload, cfg: argparse.Namespace) -> list[dict]:
    from mlx_lm.generate import generation_stream

    with mx.stream(generation_stream):
        gen, cache, y = prefilled_batch(model, wl, cfg)
        out = [raw_steps(model, cache, y, v, cfg.raw_steps, cfg.raw_warm)
               for v in ("raw", "pipelined", "+logprobs")]
    gen.close()
    return out


# -- (b) the bare BatchGenerator loop ----------------------------------------------------------
def run_bare(model: Any, wl: Workload, cfg: argparse.Namespace, profile: bool = False) -> dict:
    n = len(wl.prompts)
    rec = StepRecorder(n)
    with recording(rec), (generator_profile(rec) if profile else contextlib.nullcontext()):
        gen = _generator(TimedModel(model, rec) if profile else model, n, cfg)
        cpu0, t0 = time.thread_time(), pc()
        gen.insert([list(p) for p in wl.prompts], max_tokens=list(wl.max_tokens))
        done = tokens = 0
        while done < n:
            _, generated = gen.next()
            tokens += len(generated)
            done += sum(g.finish_reason is not None for g in generated)
        rec.begin()  # closes the last step's interval
        wall, cpu = pc() - t0, time.thread_time() - cpu0
        gen.close()
    return _result("bare", n, tokens, wall, rec, profile,
                   cpu_ms_per_step={"main_thread": cpu / max(len(rec.steps), 1) * 1e3})


def _result(mode: str, n: int, tokens: int, wall: float, rec: StepRecorder, profile: bool, **extra: Any) -> dict:
    out = {"mode": mode, "concurrency": n, "output_tokens": tokens, "wall_s": wall,
           "tokens_per_s": tokens / wall, "steps": len(rec.steps), "steady": rec.steady_ms(),
           "phases": rec.phases(), **extra}
    if profile:
        out["parts_ms"] = rec.parts_ms()
    return out


def run_bare_in_thread(model: Any, wl: Workload, cfg: argparse.Namespace) -> dict:
    """Control for the per-thread stream caches: the bare loop on a thread of its own, run once."""
    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.update(result=run_bare(model, wl, cfg)))
    worker.start()
    worker.join()
    return {**box["result"], "mode": "bare, fresh thread"}


# -- (c) Pomona's engine ----------------------------------------------------------------------
class EngineSession:
    """One `AsyncEngine` for every run at one concurrency, warm-up included, as in a server.

    MLX's CUDA backend keeps its compiled-graph caches per stream, and mlx-lm's generation stream
    is thread-local: an engine built afresh for every run (a new MLX thread) would meet every batch
    shape cold again, while the bare loop, on the main thread, reuses its warm-up.
    """

    def __init__(self, model: Any, tokenizer: Any, cfg: argparse.Namespace, n: int) -> None:
        from cache_tiers.store import NullStore
        from cache_tiers.config import CacheConfig
        from engine.config import EngineConfig
        from engine.loop import AsyncEngine, Loaded

        self.n, self.tokenizer = n, tokenizer
        self.model = TimedModel(model, None)  # times graph building only while a profile run sets .rec
        extra = {} if cfg.prefill_group_ratio is None else {"prefill_group_ratio": cfg.prefill_group_ratio}
        if getattr(cfg, "first_token_first", None):
            extra["first_token_first"] = cfg.first_token_first == "on"
        config = EngineConfig(model="random-llama", max_running=n, prefill_batch=min(cfg.prefill_batch, n),
                              prefill_chunk=cfg.prefill_chunk, request_timeout_s=None,
                              cache=CacheConfig(enabled=False), **extra)
        self.aengine = AsyncEngine(
            config, loader=lambda c: Loaded(self.model, tokenizer, CONTEXT, "random-llama", "random"),
            store_factory=lambda c, l: NullStore())

    async def start(self) -> None:
        await self.aengine.wait_ready(timeout=600)

    async def settings(self) -> dict:
        """The engine's scheduling settings as resolved on this device ("auto" made concrete)."""
        def read(engine: Any) -> dict:
            sch = engine.scheduler
            return {"first_token_first": getattr(sch, "first_token_first", None),
                    "prefill_group_ratio": getattr(sch, "group_ratio", None),
                    "direct_first_token_limit": getattr(engine, "_direct_limit", None)}
        return await self.aengine.call(read)

    async def close(self) -> None:
        await self.aengine.shutdown()

    def _profile_timers(self, rec: StepRecorder, stack: contextlib.ExitStack) -> None:
        """Pomona's parts, the detokenizer its `TextStream` uses, and mlx-lm's step (outside in)."""
        from engine.engine import Engine
        from engine.batch_generator import BatchGeneratorRunner as Runner
        from engine.text import TextStream

        self.model.rec = rec
        stack.callback(setattr, self.model, "rec", None)
        stack.enter_context(generator_profile(rec))
        stack.enter_context(timers(rec, [
            (TextStream, "add", "TextStream.add"),
            (engine_detokenizer_class(self.tokenizer), "add_token", "detok.add_token"),
            (Engine, "step", "engine.step"), (Engine, "_on_generated", "engine._on_generated"),
            (Engine, "_on_prompts", "engine._on_prompts"), (Runner, "step", "runner.step"),
            (self.aengine, "_handle_commands", "loop._handle_commands"),
            (self.aengine, "_publish_stats", "loop._publish_stats"),
            (self.aengine, "_deliver", "loop._deliver"),
        ]))

    def _requests(self, wl: Workload, tag: str) -> list:
        from engine.types import Request, SamplingParams

        return [Request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True), request_id=f"{tag}-{i}")
                for i, (p, m) in enumerate(zip(wl.prompts, wl.max_tokens))]

    async def _consume(self, request: Any) -> tuple[int, int]:
        tokens = chars = 0
        async for batch in self.aengine.stream(request):
            for event in batch:
                tokens += event.token_id is not None
                chars += len(event.text)
        return tokens, chars

    async def run(self, wl: Workload, tag: str, profile: bool = False) -> dict:
        rec = StepRecorder(self.n)
        requests = self._requests(wl, tag)
        with contextlib.ExitStack() as stack:
            stack.enter_context(recording(rec))
            if profile:
                self._profile_timers(rec, stack)
            mlx_cpu0 = await self.aengine.call(lambda engine: time.thread_time())
            main_cpu0, t0 = time.thread_time(), pc()
            counts = await asyncio.gather(*(self._consume(r) for r in requests))
            wall, main_cpu = pc() - t0, time.thread_time() - main_cpu0

            def close_interval(engine: Any) -> float:
                rec.begin()  # closes the last step's interval
                return time.thread_time()

            mlx_cpu = await self.aengine.call(close_interval) - mlx_cpu0
        tokens = sum(c[0] for c in counts)
        steps = max(len(rec.steps), 1)
        return _result("engine", self.n, tokens, wall, rec, profile, text_chars=sum(c[1] for c in counts),
                       cpu_ms_per_step={"mlx_thread": mlx_cpu / steps * 1e3, "asyncio_thread": main_cpu / steps * 1e3})
