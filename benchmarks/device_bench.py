"""Per-step cost on a real accelerator: raw decode step vs bare `BatchGenerator` vs Pomona's engine.

One process, one random llama (about 1.04B parameters, bf16 on a GPU; `--tiny` for a CPU smoke
test), one seeded workload per concurrency (prompts of random ids, 100-1,000 tokens; 128-256 output
tokens each; EOS ignored so every request produces exactly its `max_tokens`). For each concurrency:

- raw:    `model(...)` on the batch cache that `BatchGenerator` built for these prompts, greedy
          argmax on the device, `mx.eval` every step (decode only). Two more rungs add what
          `BatchGenerator._step` adds: `pipelined` (async_eval of step t+1 before waiting for t,
          `.tolist()` of the tokens) and `+logprobs` (log-softmax over the vocabulary and
          `list(logprobs)`, one array per sequence, evaluated every step).
- bare:   a `BatchGenerator` loop: insert every request, `next()` until all are done, greedy.
- engine: Pomona's `AsyncEngine` through its asyncio API (no HTTP): one task per request consuming
          `stream()`, with a real byte-level BPE tokenizer of the model's vocabulary size and mlx-lm's
          `BPEStreamingDetokenizer`, so detokenization is part of the cost.

Reported per mode: end-to-end output tokens/s (prefill and the shrinking tail included: bare and
engine only) and the steady-state decode step: the mean time between the starts of consecutive
`BatchGenerator.next()` calls over the steps where every request is decoding (full batch, no
prefill pending, none finishing), which is what the raw rungs time too.

`--profile` adds instrumented runs (timers wrapped around library and Pomona functions from the
outside; nothing is edited) that split that step into: forward-graph build, kernel launch
(`mx.async_eval`), waiting (`mx.eval`), the rest of `GenerationBatch._step`, the per-sequence
response loop, `BatchGenerator` bookkeeping; and on Pomona's side the runner's mapping,
detokenization, stop-string checks, event building, the rest of `Engine.step`, the hand-off to
asyncio, and the MLX thread's unaccounted time (GIL waits while the asyncio side runs).

    python -m benchmarks.device_bench --tiny                    # CPU smoke test
    python -m benchmarks.device_bench --repeats 2 --profile      # the device run (docs/accelerators.md)

JSON goes to --json, or to $OUT/device_bench.json when OUT is set.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

if __package__ in (None, ""):  # `python benchmarks/device_bench.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx

pc = time.perf_counter

# hidden 2048, 16 layers, MLP 8192, 32/8 heads, 32,000 tied vocabulary: 1.04B parameters, the
# size of the issue's measurements.
MODEL_1B = dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=True)
MODEL_TINY = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True)
CONTEXT = 4096
SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>")


# -- model, tokenizer, workload ---------------------------------------------------------------
def build_model(shape: dict, dtype: mx.Dtype, seed: int) -> tuple[Any, int]:
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    args = llama.ModelArgs.from_dict({
        "model_type": "llama", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": CONTEXT, **shape,
    })
    mx.random.seed(seed)
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    return model, params


def build_tokenizer(vocab_size: int, seed: int, folder: Path) -> Any:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids, loaded the way mlx-lm loads one.

    256 byte symbols, merges that grow short tokens one letter at a time, and two specials at the
    end (EOS last), like Llama 3's layout. `mlx_lm.tokenizer_utils.load` sees the ByteLevel decoder
    and picks `BPEStreamingDetokenizer`, the detokenizer Llama 3 and Qwen checkpoints get.
    """
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    rng = random.Random(seed)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    letters = [c for c in alphabet if c.isascii() and c.isalpha()] + ["Ġ"] * 6  # "Ġ" is the space byte
    vocab = {c: i for i, c in enumerate(alphabet)}
    growable = list(alphabet)
    merges = []
    while len(vocab) < vocab_size - len(SPECIALS):
        a, b = rng.choice(growable), rng.choice(letters)
        if a + b in vocab:
            continue
        vocab[a + b] = len(vocab)
        merges.append((a, b))
        if len(a) < 7:
            growable.append(a + b)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": SPECIALS[1],
        "model_max_length": CONTEXT,
    }))
    tokenizer = load_tokenizer(folder)
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} ids, the model {vocab_size}")
    return tokenizer


@dataclass(frozen=True)
class Workload:
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def make_workload(n: int, vocab_size: int, prompt_len: tuple[int, int], out_len: tuple[int, int],
                  seed: int) -> Workload:
    rng = random.Random(seed * 1000003 + n)
    ids = vocab_size - len(SPECIALS)
    prompts = tuple(tuple(rng.randrange(ids) for _ in range(rng.randint(*prompt_len))) for _ in range(n))
    return Workload(prompts, tuple(rng.randint(*out_len) for _ in range(n)))


# -- step recording and timers ----------------------------------------------------------------
class StepRecorder:
    """One record per `BatchGenerator.next()`: when it started, whether it was a steady decode step
    (every request decoding, nothing to prefill, none finishing), and the parts timed inside it.
    A step's interval runs from its start to the next step's start, so it includes whatever the
    caller did with the responses."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.steps: list[dict] = []
        self.cur: dict | None = None

    def begin(self, gen: Any) -> None:
        now = pc()
        if self.cur is not None:
            self.cur["interval"] = now - self.cur["t0"]
            self.steps.append(self.cur)
        decoding = len(gen._generation_batch)
        full = decoding == self.n and not gen._unprocessed_sequences and len(gen._prompt_batch) == 0
        self.cur = {"t0": now, "full": full, "decoding": decoding, "parts": defaultdict(float), "gen": gen,
                    "prompt_tokens0": gen._counters.prompt_tokens}

    def end(self, prompt_responses: list, generation_responses: list) -> None:
        cur = self.cur
        cur["parts"]["bg.next"] += pc() - cur["t0"]
        cur["prompt_tokens"] = cur.pop("gen")._counters.prompt_tokens - cur.pop("prompt_tokens0")
        cur["pure"] = (cur["full"] and not prompt_responses and len(generation_responses) == self.n
                       and all(r.finish_reason is None for r in generation_responses))

    def add(self, key: str, seconds: float) -> None:
        if self.cur is not None:
            self.cur["parts"][key] += seconds

    def phases(self) -> dict:
        """Where the wall time went: steps that prefilled, steady full-batch steps, other decode steps."""
        out = {}
        for name, test in (("prefill", lambda s: s.get("prompt_tokens", 0) > 0), ("steady", lambda s: s.get("pure")),
                           ("other decode", lambda s: not s.get("pure") and not s.get("prompt_tokens", 0))):
            chosen = [s for s in self.steps if test(s)]
            out[name] = {"steps": len(chosen), "seconds": sum(s["interval"] for s in chosen),
                         "prompt_tokens": sum(s.get("prompt_tokens", 0) for s in chosen),
                         "mean_decoding": statistics.fmean(s["decoding"] for s in chosen) if chosen else 0.0}
        return out

    def pure(self) -> list[dict]:
        return [s for s in self.steps if s.get("pure")]

    def steady_ms(self) -> dict:
        ms = [s["interval"] * 1e3 for s in self.pure()]
        if not ms:
            return {"steps": 0, "mean": None, "median": None}
        return {"steps": len(ms), "mean": statistics.fmean(ms), "median": statistics.median(ms),
                "p90": sorted(ms)[int(0.9 * (len(ms) - 1))]}

    def parts_ms(self) -> dict[str, float]:
        pure = self.pure()
        keys = sorted({k for s in pure for k in s["parts"]})
        out = {k: statistics.fmean(s["parts"].get(k, 0.0) for s in pure) * 1e3 for k in keys}
        out["interval"] = statistics.fmean(s["interval"] for s in pure) * 1e3 if pure else 0.0
        return out


def timed(fn: Callable, key: str, rec: StepRecorder) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = pc()
        try:
            return fn(*args, **kwargs)
        finally:
            rec.add(key, pc() - t)

    return wrapper


class _TimedMx:
    """Stands in for `mlx.core` inside `mlx_lm.generate` only: times `eval` and `async_eval`."""

    def __init__(self, rec: StepRecorder) -> None:
        self._rec = rec

    def eval(self, *args: Any) -> Any:
        t = pc()
        try:
            return mx.eval(*args)
        finally:
            self._rec.add("mx.eval", pc() - t)

    def async_eval(self, *args: Any) -> Any:
        t = pc()
        try:
            return mx.async_eval(*args)
        finally:
            self._rec.add("mx.async_eval", pc() - t)

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)


class TimedModel:
    """The model, with the Python time of building each forward graph recorded (MLX is lazy: the
    call only records the graph; the kernels run at `async_eval`/`eval`)."""

    def __init__(self, model: Any, rec: StepRecorder | None) -> None:
        self._model, self.rec = model, rec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.rec is None:
            return self._model(*args, **kwargs)
        t = pc()
        try:
            return self._model(*args, **kwargs)
        finally:
            self.rec.add("model_build", pc() - t)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


@contextlib.contextmanager
def patched(rec: StepRecorder, targets: Sequence[tuple[Any, str, str]]) -> Iterator[None]:
    """Wrap `owner.name` with a timer for `rec` (class or instance attributes), restore on exit."""
    saved = []
    try:
        for owner, name, key in targets:
            own = vars(owner).get(name)  # None: inherited (class) or a bound method (instance)
            setattr(owner, name, timed(getattr(owner, name), key, rec))
            saved.append((owner, name, own))
        yield
    finally:
        for owner, name, own in reversed(saved):
            if own is not None:
                setattr(owner, name, own)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)


@contextlib.contextmanager
def generator_profile(rec: StepRecorder) -> Iterator[None]:
    """Timers inside mlx-lm's `GenerationBatch` and its use of `mx.eval` (from the outside)."""
    import importlib

    G = importlib.import_module("mlx_lm.generate")  # the package re-exports a function `generate`
    real_mx = G.mx
    G.mx = _TimedMx(rec)
    try:
        with patched(rec, [(G.GenerationBatch, "next", "gb.next"), (G.GenerationBatch, "_step", "gb._step"),
                           (G.GenerationBatch, "filter", "gb.filter")]):
            yield
    finally:
        G.mx = real_mx


# -- (a) the raw step ---------------------------------------------------------------------------
def prefilled_batch(model: Any, wl: Workload, cfg: argparse.Namespace) -> tuple[Any, Any, Any]:
    """Let a `BatchGenerator` prefill every prompt; return it, its batch cache and next inputs."""
    from mlx_lm.generate import BatchGenerator

    n = len(wl.prompts)
    gen = BatchGenerator(model, stop_tokens=None, completion_batch_size=n,
                         prefill_batch_size=min(cfg.prefill_batch, n), prefill_step_size=cfg.prefill_chunk)
    gen.insert([list(p) for p in wl.prompts], max_tokens=[10**6] * n)
    while not (len(gen._generation_batch) == n and not gen._unprocessed_sequences and len(gen._prompt_batch) == 0):
        gen.next()
    batch = gen._generation_batch
    mx.eval(batch._next_tokens, [c.state for c in batch.prompt_cache])
    return gen, batch.prompt_cache, batch._next_tokens


def raw_steps(model: Any, cache: list, y: mx.array, variant: str, steps: int, warm: int) -> dict:
    """Time `steps` decode steps (after `warm` untimed ones), then trim the cache back."""

    def forward(tokens: mx.array) -> tuple[mx.array, Any]:
        logits = model(tokens[:, None], cache=cache)[:, -1, :]
        if variant == "raw":
            return mx.argmax(logits, axis=-1), None
        if variant == "pipelined":
            return mx.argmax(logits, axis=-1), []
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # as GenerationBatch._step
        return mx.argmax(logprobs, axis=-1), list(logprobs)

    build = wait = 0.0
    times = []
    total = warm + steps
    if variant == "raw":
        for i in range(total):
            t0 = pc()
            y, _ = forward(y)
            t1 = pc()
            mx.eval(y)
            t2 = pc()
            if i >= warm:
                build, wait = build + t1 - t0, wait + t2 - t1
                times.append(t2 - t0)
    else:  # BatchGenerator's double buffering: launch step t+1, then wait for step t
        nxt, nxt_lp = forward(y)
        mx.async_eval(nxt, nxt_lp)
        for i in range(total):
            t0 = pc()
            cur, cur_lp = nxt, nxt_lp
            nxt, nxt_lp = forward(cur)
            t1 = pc()
            mx.async_eval(nxt, nxt_lp)
            mx.eval(cur, cur_lp)
            cur.tolist()
            t2 = pc()
            if i >= warm:
                build, wait = build + t1 - t0, wait + t2 - t1
                times.append(t2 - t0)
        mx.eval(nxt, nxt_lp)
        total += 1
    for c in cache:
        c.trim(total)
    ms = statistics.fmean(times) * 1e3
    return {"variant": variant, "steps": steps, "ms_per_step": ms, "median_ms": statistics.median(times) * 1e3,
            "tokens_per_s": y.shape[0] * 1e3 / ms, "graph_build_ms": build / steps * 1e3,
            "launch_and_wait_ms": wait / steps * 1e3}


def run_raw(model: Any, wl: Workload, cfg: argparse.Namespace) -> list[dict]:
    with mx.stream(_generation_stream()):
        gen, cache, y = prefilled_batch(model, wl, cfg)
        out = [raw_steps(model, cache, y, v, cfg.raw_steps, cfg.raw_warm)
               for v in ("raw", "pipelined", "+logprobs")]
    gen.close()
    return out


def _generation_stream() -> Any:
    from mlx_lm.generate import generation_stream

    return generation_stream


# -- (b) the bare BatchGenerator loop ----------------------------------------------------------
def run_bare(model: Any, wl: Workload, cfg: argparse.Namespace, profile: bool = False) -> dict:
    from mlx_lm.generate import BatchGenerator

    n = len(wl.prompts)
    rec = StepRecorder(n)
    ctx = generator_profile(rec) if profile else contextlib.nullcontext()
    with ctx:
        gen = BatchGenerator(TimedModel(model, rec) if profile else model, stop_tokens=None,
                             completion_batch_size=n, prefill_batch_size=min(cfg.prefill_batch, n),
                             prefill_step_size=cfg.prefill_chunk)
        cpu0, t0 = time.thread_time(), pc()
        gen.insert([list(p) for p in wl.prompts], max_tokens=list(wl.max_tokens))
        done = tokens = 0
        while done < n:
            rec.begin(gen)
            prompt_responses, generated = gen.next()
            rec.end(prompt_responses, generated)
            for g in generated:
                tokens += 1
                if g.finish_reason is not None:
                    done += 1
        rec.begin(gen)  # closes the last step's interval
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


# -- (c) Pomona's engine ----------------------------------------------------------------------
class EngineSession:
    """One `AsyncEngine` for every run at one concurrency, warm-up included, as in a server.

    MLX's CUDA backend keeps its compiled-graph caches per stream, and mlx-lm's generation stream
    is thread-local: an engine built afresh for every run (a new MLX thread) would meet every batch
    shape cold again, while the bare loop, on the main thread, reuses its warm-up.
    """

    def __init__(self, model: Any, tokenizer: Any, cfg: argparse.Namespace, n: int) -> None:
        from cache_tiers.store import NullStore
        from engine.config import CacheConfig, EngineConfig
        from engine.loop import AsyncEngine, Loaded

        self.n, self.tokenizer = n, tokenizer
        self.model = TimedModel(model, None)  # times graph building only while a profile run sets .rec
        config = EngineConfig(model="random-llama", max_running=n, prefill_batch=min(cfg.prefill_batch, n),
                              prefill_chunk=cfg.prefill_chunk, request_timeout_s=None,
                              cache=CacheConfig(enabled=False))
        self.aengine = AsyncEngine(
            config, loader=lambda c: Loaded(self.model, tokenizer, CONTEXT, "random-llama", "random"),
            store_factory=lambda c, l: NullStore())

    async def start(self) -> None:
        await self.aengine.wait_ready(timeout=600)

    async def close(self) -> None:
        await self.aengine.shutdown()

    async def run(self, wl: Workload, tag: str, profile: bool = False) -> dict:
        from engine.types import Request, SamplingParams

        n, aengine = self.n, self.aengine
        rec = StepRecorder(n)
        stack = contextlib.ExitStack()
        if profile:
            from engine.text import TextStream

            self.model.rec = rec
            stack.callback(setattr, self.model, "rec", None)
            stack.enter_context(generator_profile(rec))
            stack.enter_context(patched(rec, [
                (TextStream, "add", "TextStream.add"),
                (type(self.tokenizer._detokenizer), "add_token", "detok.add_token"),
                (aengine, "_handle_commands", "loop._handle_commands"),
                (aengine, "_publish_stats", "loop._publish_stats"),
                (aengine, "_deliver", "loop._deliver"),
            ]))
        wrapped: list[tuple[Any, str]] = []

        def install(engine: Any) -> float:
            """On the MLX thread: mark step boundaries at `BatchGenerator.next`, time Pomona's parts."""
            gen = engine.runner._generator
            real_next = gen.next

            def next_() -> Any:
                rec.begin(gen)
                prompt_responses, generated = real_next()
                rec.end(prompt_responses, generated)
                return prompt_responses, generated

            gen.next = next_
            wrapped.append((gen, "next"))
            if profile:
                for owner, name, key in ((engine, "step", "engine.step"), (engine, "_on_generated", "engine._on_generated"),
                                         (engine, "_on_prompts", "engine._on_prompts"), (engine.runner, "step", "runner.step")):
                    setattr(owner, name, timed(getattr(owner, name), key, rec))
                    wrapped.append((owner, name))
            return time.thread_time()

        def uninstall(engine: Any) -> float:
            rec.begin(engine.runner._generator)  # closes the last step's interval
            for owner, name in wrapped:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            return time.thread_time()

        requests = [Request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True),
                            request_id=f"{tag}-{i}") for i, (p, m) in enumerate(zip(wl.prompts, wl.max_tokens))]

        async def consume(request: Request) -> tuple[int, int]:
            tokens = chars = 0
            async for batch in aengine.stream(request):
                for event in batch:
                    tokens += event.token_id is not None
                    chars += len(event.text)
            return tokens, chars

        with stack:
            mlx_cpu0 = await aengine.call(install)
            main_cpu0 = time.thread_time()
            t0 = pc()
            counts = await asyncio.gather(*(consume(r) for r in requests))
            wall = pc() - t0
            main_cpu = time.thread_time() - main_cpu0
            mlx_cpu = await aengine.call(uninstall) - mlx_cpu0
        tokens = sum(c[0] for c in counts)
        steps = max(len(rec.steps), 1)
        return _result("engine", n, tokens, wall, rec, profile, text_chars=sum(c[1] for c in counts),
                       cpu_ms_per_step={"mlx_thread": mlx_cpu / steps * 1e3, "asyncio_thread": main_cpu / steps * 1e3})


def run_bare_in_thread(model: Any, wl: Workload, cfg: argparse.Namespace) -> dict:
    """Control for the per-thread stream caches: the bare loop on a thread of its own, run once."""
    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.update(result=run_bare(model, wl, cfg)))
    worker.start()
    worker.join()
    return {**box["result"], "mode": "bare, fresh thread"}


# -- reporting --------------------------------------------------------------------------------
def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def summarize(results: dict) -> tuple[str, dict]:
    lines = ["| N | mode | end-to-end tok/s | steady ms/step | steady tok/s | spread ms/step | steady steps |",
             "| --- | --- | ---: | ---: | ---: | --- | ---: |"]
    ratios = {}
    for n, by in results["runs"].items():
        n_ = by["n"]
        summary = {}
        for variant in ("raw", "pipelined", "+logprobs"):
            ms = [r["ms_per_step"] for r in by["raw"] if r["variant"] == variant]
            summary[variant] = {"ms": _median(ms), "tps": None, "spread": ms, "steps": by["raw"][0]["steps"] if ms else 0}
        for mode in ("bare", "engine", "bare_thread"):
            ms = [r["steady"]["mean"] for r in by[mode]]
            summary[mode] = {"ms": _median(ms), "tps": _median([r["tokens_per_s"] for r in by[mode]]),
                             "spread": ms, "steps": _median([r["steady"]["steps"] for r in by[mode]])}
        for name, s in summary.items():
            if s["ms"] is None and s["tps"] is None:
                continue
            label = {"raw": "raw step", "pipelined": "raw, pipelined + tolist",
                     "+logprobs": "raw, pipelined + logprobs split", "bare": "bare BatchGenerator",
                     "engine": "Pomona engine (AsyncEngine)", "bare_thread": "bare, on a fresh thread"}[name]
            steady_tps = None if s["ms"] is None else n_ * 1e3 / s["ms"]
            spread = "/".join(_fmt(v) for v in s["spread"]) if s["spread"] else "-"
            lines.append(f"| {n} | {label} | {_fmt(s['tps'], ',.0f')} | {_fmt(s['ms'])} | "
                         f"{_fmt(steady_tps, ',.0f')} | {spread} | {_fmt(s['steps'], '.0f')} |")

        def ratio(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None or b == 0 else a / b

        ratios[n] = {
            "engine/bare tok/s (end to end)": ratio(summary["engine"]["tps"], summary["bare"]["tps"]),
            "engine/bare (steady step, bare ms / engine ms)": ratio(summary["bare"]["ms"], summary["engine"]["ms"]),
            "bare/raw (steady step, raw ms / bare ms)": ratio(summary["raw"]["ms"], summary["bare"]["ms"]),
        }
    lines.append("")
    lines.append("| N | engine/bare tok/s (end to end) | engine/bare (steady step) | bare/raw (steady step) |")
    lines.append("| --- | ---: | ---: | ---: |")
    for n, r in ratios.items():
        vals = list(r.values())
        lines.append(f"| {n} | {_fmt(vals[0], '.3f')} | {_fmt(vals[1], '.3f')} | {_fmt(vals[2], '.3f')} |")
    return "\n".join(lines), ratios


def phases_table(results: dict) -> str:
    lines = ["| run | steps | prefill steps (s) | steady steps (s) | other decode steps (s) | wall s |",
             "| --- | ---: | --- | --- | --- | ---: |"]
    for label, by in results["runs"].items():
        for mode in ("bare", "engine", "bare_thread"):
            for r in by[mode]:
                ph = r["phases"]
                cells = [f"{ph[k]['steps']} ({ph[k]['seconds']:.2f})" for k in ("prefill", "steady", "other decode")]
                lines.append(f"| {mode} {label} | {r['steps']} | " + " | ".join(cells) + f" | {r['wall_s']:.2f} |")
    return "\n".join(lines)


def _unaccounted(p: dict[str, float]) -> float:
    """The step interval outside everything timed: the caller's own loop, and for the engine the
    MLX thread's waits for the GIL while the asyncio thread consumes events."""
    if "engine.step" not in p:
        return p["interval"] - p.get("bg.next", 0.0)
    return p["interval"] - sum(p.get(k, 0.0) for k in (
        "engine.step", "loop._handle_commands", "loop._publish_stats", "loop._deliver"))


def _g(p: dict[str, float], *keys: str) -> float:
    return p.get(keys[0], 0.0) - sum(p.get(k, 0.0) for k in keys[1:])


PROFILE_ROWS: list[tuple[str, bool, Callable[[dict[str, float]], float]]] = [  # (label, engine only, value)
    ("forward graph build (Python, model(...))", False, lambda p: _g(p, "model_build")),
    ("kernel launch (mx.async_eval)", False, lambda p: _g(p, "mx.async_eval")),
    ("wait for the previous step (mx.eval)", False, lambda p: _g(p, "mx.eval")),
    ("rest of _step: logsumexp/sampler graph, list(logprobs), .tolist()", False,
     lambda p: _g(p, "gb._step", "model_build", "mx.async_eval", "mx.eval")),
    ("per-sequence loop: max_tokens, stop matchers, Response objects", False,
     lambda p: _g(p, "gb.next", "gb._step", "gb.filter")),
    ("BatchGenerator._next bookkeeping", False, lambda p: _g(p, "bg.next", "gb.next")),
    ("= BatchGenerator.next()", False, lambda p: _g(p, "bg.next")),
    ("runner: uid mapping, Generated objects", True, lambda p: _g(p, "runner.step", "bg.next")),
    ("detokenization (BPEStreamingDetokenizer.add_token)", True, lambda p: _g(p, "detok.add_token")),
    ("stop-string check / release (TextStream)", True, lambda p: _g(p, "TextStream.add", "detok.add_token")),
    ("events, per-request bookkeeping (_on_generated)", True,
     lambda p: _g(p, "engine._on_generated", "TextStream.add")),
    ("Engine.step rest: expire, view, schedule, stats", True,
     lambda p: _g(p, "engine.step", "runner.step", "engine._on_generated", "engine._on_prompts")),
    ("hand-off to asyncio (_deliver)", True, lambda p: _g(p, "loop._deliver")),
    ("commands + stats (_handle_commands, _publish_stats)", True,
     lambda p: _g(p, "loop._handle_commands") + _g(p, "loop._publish_stats")),
    ("caller's loop / unaccounted (GIL waits)", False, _unaccounted),
    ("= step interval", False, lambda p: p["interval"]),
]


def profile_table(results: dict) -> str:
    cols = []
    for n, by in results["runs"].items():
        for mode in ("bare", "engine"):
            for r in by.get(f"{mode}_profile", []):
                cols.append((mode, f"{mode} N={n}", r["parts_ms"]))
    if not cols:
        return ""
    lines = ["| ms per steady step | " + " | ".join(c[1] for c in cols) + " |",
             "| --- |" + " ---: |" * len(cols)]
    for label, engine_only, fn in PROFILE_ROWS:
        vals = ["-" if engine_only and mode == "bare" else f"{fn(parts):.3f}" for mode, _, parts in cols]
        lines.append(f"| {label} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def check_detokenizer(tokenizer: Any, vocab_size: int, seed: int, streams: int = 300) -> dict:
    """If Pomona swaps in its own detokenizer, check it gives mlx-lm's text after every token."""
    from engine import text as pomona_text

    fast = getattr(pomona_text, "fast_detokenizer", None)
    mine = fast(tokenizer.detokenizer) if fast else tokenizer.detokenizer
    if fast is None or type(mine) is type(tokenizer.detokenizer):
        return {"detokenizer": type(mine).__name__, "checked": False}
    rng = random.Random(seed)
    mismatches = 0
    for _ in range(streams):
        ref, got = tokenizer.detokenizer, fast(tokenizer.detokenizer)
        for _ in range(rng.randint(1, 64)):
            t = rng.randrange(vocab_size) if rng.random() < 0.7 else rng.randrange(256)
            ref.add_token(t)
            got.add_token(t)
            mismatches += ref.text != got.text
        ref.finalize()
        got.finalize()
        mismatches += ref.text != got.text
    if mismatches:
        raise RuntimeError(f"{type(mine).__name__} differs from mlx-lm's detokenizer ({mismatches} mismatches)")
    return {"detokenizer": type(mine).__name__, "checked": True, "streams": streams, "identical": True}


def environment(params: int, dtype: mx.Dtype) -> dict:
    import mlx_lm

    env = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "python": platform.python_version(),
           "device": str(mx.default_device()), "params": params, "dtype": str(dtype), "machine": platform.machine(),
           "cpus": os.cpu_count()}
    with contextlib.suppress(Exception):
        env["device_info"] = {k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))}
    return env


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small model and sizes, for a CPU smoke test")
    p.add_argument("--concurrency", help="comma-separated N or N:MIN-MAX (prompt lengths for that run); "
                                         "default 32,128 (--tiny 4,8)")
    p.add_argument("--prompt-len", help="min,max prompt tokens (default 100,1000; --tiny 20,60)")
    p.add_argument("--out-len", help="min,max output tokens (default 128,256; --tiny 8,16)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs of each mode per concurrency")
    p.add_argument("--raw-steps", type=int, help="timed raw steps per rung (default 64; --tiny 8)")
    p.add_argument("--raw-warm", type=int, default=4)
    p.add_argument("--prefill-batch", type=int, default=8, help="as EngineConfig.prefill_batch")
    p.add_argument("--prefill-chunk", type=int, default=256, help="as EngineConfig.prefill_chunk")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                   help="default: float32 on the CPU backend, bfloat16 on GPUs")
    p.add_argument("--modes", default="raw,bare,engine", help="raw,bare,engine and/or bare_thread (a control)")
    p.add_argument("--profile", nargs="?", const="all",
                   help="also run instrumented bare and engine passes (for these --concurrency items; default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--switch-interval", type=float, help="sys.setswitchinterval (GIL hand-over), seconds")
    p.add_argument("--length-group-ratio", type=float,
                   help="experiment: override engine.scheduler.LENGTH_GROUP_RATIO (prompts prefilled together)")
    p.add_argument("--json", help="write results here (default $OUT/device_bench.json when OUT is set)")
    cfg = p.parse_args(argv)

    def pair(text: str | None, default: tuple[int, int]) -> tuple[int, int]:
        return default if text is None else tuple(int(x) for x in text.split(","))  # type: ignore[return-value]

    cfg.prompt_len = pair(cfg.prompt_len, (20, 60) if cfg.tiny else (100, 1000))
    cfg.out_len = pair(cfg.out_len, (8, 16) if cfg.tiny else (128, 256))
    workloads = []  # (label, n, prompt_len)
    for item in (cfg.concurrency or ("4,8" if cfg.tiny else "32,128")).split(","):
        n, _, lens = item.partition(":")
        workloads.append((item, int(n), tuple(int(x) for x in lens.split("-")) if lens else cfg.prompt_len))
    profile_labels = None if cfg.profile is None else (
        {w[0] for w in workloads} if cfg.profile == "all" else set(cfg.profile.split(",")))
    cfg.raw_steps = cfg.raw_steps or (8 if cfg.tiny else 64)
    modes = set(cfg.modes.split(","))
    on_gpu = mx.default_device() == mx.gpu
    dtype = getattr(mx, cfg.dtype) if cfg.dtype else (mx.bfloat16 if on_gpu else mx.float32)

    t_start = pc()
    shape = MODEL_TINY if cfg.tiny else MODEL_1B
    model, params = build_model(shape, dtype, cfg.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_tokenizer(shape["vocab_size"], cfg.seed, Path(tmp))
    env = environment(params, dtype)
    env["detokenizer_check"] = check_detokenizer(tokenizer, shape["vocab_size"], cfg.seed)
    if cfg.switch_interval is not None:
        sys.setswitchinterval(cfg.switch_interval)
    env["switch_interval_s"] = sys.getswitchinterval()
    if cfg.length_group_ratio is not None:
        import engine.scheduler

        engine.scheduler.LENGTH_GROUP_RATIO = cfg.length_group_ratio
        env["length_group_ratio"] = cfg.length_group_ratio
    print(f"# {params / 1e6:,.1f}M-parameter random llama, {dtype}, on {env['device']}; mlx {env['mlx']}, "
          f"mlx-lm {env['mlx_lm']}; built in {pc() - t_start:.1f} s", flush=True)

    results: dict[str, Any] = {"env": env, "config": {k: v for k, v in vars(cfg).items()}, "model": shape,
                               "runs": {}}
    for label, n, prompt_len in workloads:
        wl = make_workload(n, shape["vocab_size"], prompt_len, cfg.out_len, cfg.seed)
        by: dict[str, Any] = {"n": n, "prompt_len": prompt_len, "raw": [], "bare": [], "engine": [],
                              "bare_thread": [], "bare_profile": [], "engine_profile": []}
        results["runs"][label] = by
        asyncio.run(_measure(model, tokenizer, wl, cfg, label, by, modes,
                             profile_labels is not None and label in profile_labels))
    results["wall_s"] = pc() - t_start
    results["wall_s"] = pc() - t_start

    table, ratios = summarize(results)
    results["ratios"] = ratios
    prof = profile_table(results)
    results["table_md"], results["profile_md"] = table, prof
    out = cfg.json or (os.path.join(os.environ["OUT"], "device_bench.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(results, indent=1, default=str))
    results.pop("phases_md", None)
    results["phases_md"] = phases = phases_table(results)
    if prof:
        print("\n" + prof)
    print("\n" + phases)
    raw_detail = ["", "| N | raw rung | ms/step | graph build ms | launch + wait ms |", "| --- | --- | ---: | ---: | ---: |"]
    for n, by in results["runs"].items():
        for r in by["raw"]:
            raw_detail.append(f"| {n} | {r['variant']} | {r['ms_per_step']:.3f} | {r['graph_build_ms']:.3f} | "
                              f"{r['launch_and_wait_ms']:.3f} |")
    print("\n".join(raw_detail))
    for n, by in results["runs"].items():
        for r in by["bare"]:
            print(f"# bare N={n}: CPU ms/step of the calling thread {r['cpu_ms_per_step']['main_thread']:.3f}")
        for r in by["engine"] + by["engine_profile"]:
            print(f"# engine N={n}{' (profiled)' if 'parts_ms' in r else ''}: CPU ms/step mlx thread {r['cpu_ms_per_step']['mlx_thread']:.3f}, "
                  f"asyncio thread {r['cpu_ms_per_step']['asyncio_thread']:.3f}")
    print("\n" + table)
    print(f"\n# total {results['wall_s']:.1f} s" + (f"; JSON in {out}" if out else ""), flush=True)
    return 0


async def _measure(model: Any, tokenizer: Any, wl: Workload, cfg: argparse.Namespace, label: str, by: dict,
                   modes: set[str], profile: bool) -> None:
    """Warm up, then the timed repeats, then the profiled passes, for one workload."""
    t = pc()
    run_bare(model, wl, cfg)  # warm-up: every kernel and batch shape these runs meet
    session = None
    if "engine" in modes:
        session = EngineSession(model, tokenizer, cfg, by["n"])
        await session.start()
        await session.run(wl, f"warm-{label}")
    print(f"# {label}: {len(wl.prompts)} requests, {sum(map(len, wl.prompts))} prompt tokens, "
          f"{wl.output_tokens} output tokens; warm-up {pc() - t:.1f} s", flush=True)
    try:
        for rep in range(cfg.repeats):
            if "raw" in modes:
                by["raw"] += run_raw(model, wl, cfg)
            if "bare" in modes:
                by["bare"].append(run_bare(model, wl, cfg))
            if session is not None:
                by["engine"].append(await session.run(wl, f"{label}-r{rep}"))
            last = {k: by[k][-1] for k in ("bare", "engine") if by[k]}
            print(f"# {label} rep {rep}: " + "; ".join(
                f"{k} {r['tokens_per_s']:,.0f} tok/s, steady {_fmt(r['steady']['mean'])} ms/step"
                for k, r in last.items()) + "; raw " + ", ".join(
                f"{r['variant']} {r['ms_per_step']:.2f}" for r in by["raw"][-3:]), flush=True)
        if "bare_thread" in modes:
            by["bare_thread"].append(run_bare_in_thread(model, wl, cfg))
        if profile:
            if "bare" in modes:
                by["bare_profile"].append(run_bare(model, wl, cfg, profile=True))
            if session is not None:
                by["engine_profile"].append(await session.run(wl, f"prof-{label}", profile=True))
    finally:
        if session is not None:
            await session.close()


if __name__ == "__main__":
    rc = main()
    # MLX's CUDA backend aborts at interpreter exit ("terminate called without an active
    # exception") once threads other than the main one have used their thread-local streams; the
    # results are written by then, so leave without running C++ static destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
