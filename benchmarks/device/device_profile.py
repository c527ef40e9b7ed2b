"""Step recording and outside-in timers for the device benchmark (see `benchmarks/device/device_bench.py`).

Only public APIs: step boundaries come from wrapping `BatchGenerator.next` (and `remove`) at the
class level, the number of decoding sequences is counted from `next()`'s responses (a prompt
response with `end_of_prompt` moves a sequence into the decode batch; a generation response with a
`finish_reason`, or `remove()`, takes it out), and prompt tokens per step come from
`BatchGenerator.stats()`. Nothing in mlx-lm or Pomona is edited.
"""

from __future__ import annotations

import contextlib
import importlib
import statistics
import time
from collections import defaultdict
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx

pc = time.perf_counter


class StepRecorder:
    """One record per `BatchGenerator.next()`: when it started, whether it was a steady decode step
    (every request decoding, so nothing to prefill, and none finishing), and the parts timed inside
    it. A step's interval runs from its start to the next step's start, so it includes whatever the
    caller did with the responses."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.steps: list[dict] = []
        self.cur: dict | None = None
        self.decoding: set[int] = set()  # uids in the decode batch, counted from the responses
        self.last_eval_end = 0.0

    def begin(self) -> None:
        now = pc()
        if self.cur is not None:
            self.cur["interval"] = now - self.cur["t0"]
            self.steps.append(self.cur)
        self.cur = {"t0": now, "full": len(self.decoding) == self.n, "decoding": len(self.decoding),
                    "parts": defaultdict(float)}

    def end(self, prompt_responses: list, generation_responses: list, t_end: float, prompt_tokens: int) -> None:
        cur = self.cur
        cur["parts"]["bg.next"] += t_end - cur["t0"]
        cur["prompt_tokens"] = prompt_tokens
        self.decoding.update(r.uid for r in prompt_responses if r.end_of_prompt)
        self.decoding.difference_update(r.uid for r in generation_responses if r.finish_reason is not None)
        cur["pure"] = (cur["full"] and not prompt_responses and len(generation_responses) == self.n
                       and all(r.finish_reason is None for r in generation_responses))

    def removed(self, uids: Sequence[int]) -> None:
        self.decoding.difference_update(uids)

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


@contextlib.contextmanager
def patched(targets: Sequence[tuple[Any, str, Callable]]) -> Iterator[None]:
    """Set `owner.name = make(original)` (class or instance attributes); restore on exit."""
    saved = []
    try:
        for owner, name, make in targets:
            own = vars(owner).get(name)  # None: inherited (class) or a bound method (instance)
            setattr(owner, name, make(getattr(owner, name)))
            saved.append((owner, name, own))
        yield
    finally:
        for owner, name, own in reversed(saved):
            if own is not None:
                setattr(owner, name, own)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)


def timers(rec: StepRecorder, targets: Sequence[tuple[Any, str, str]]) -> contextlib.AbstractContextManager:
    """Wrap each `owner.name` with a timer adding to `rec` under `key`."""
    return patched([(owner, name, lambda fn, key=key: timed(fn, key, rec)) for owner, name, key in targets])


def recording(rec: StepRecorder) -> contextlib.AbstractContextManager:
    """Record every `BatchGenerator.next()` (any instance: the bare loop's or the engine's runner's)."""
    from mlx_lm.generate import BatchGenerator

    def wrap_next(real: Callable) -> Callable:
        def next_(gen: Any) -> Any:
            with gen.stats() as stats:
                rec.begin()
                prompt_responses, generation_responses = real(gen)
                t_end = pc()
            rec.end(prompt_responses, generation_responses, t_end, stats.prompt_tokens)
            return prompt_responses, generation_responses
        return next_

    def wrap_remove(real: Callable) -> Callable:
        def remove(gen: Any, uids: Any, *args: Any, **kwargs: Any) -> Any:
            rec.removed(list(uids))
            return real(gen, uids, *args, **kwargs)
        return remove

    return patched([(BatchGenerator, "next", wrap_next), (BatchGenerator, "remove", wrap_remove)])


class _TimedMx:
    """Stands in for `mlx.core` inside `mlx_lm.generate` only: times `eval` and `async_eval`."""

    def __init__(self, rec: StepRecorder) -> None:
        self._rec = rec

    def eval(self, *args: Any) -> Any:
        t = pc()
        try:
            return mx.eval(*args)
        finally:
            self._rec.last_eval_end = end = pc()
            self._rec.add("mx.eval", end - t)

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
def generator_profile(rec: StepRecorder) -> Iterator[None]:
    """Timers inside mlx-lm's decode step, from the outside: `GenerationBatch.next` and `.filter`
    (public methods) and `mx.eval`/`mx.async_eval` as `mlx_lm.generate` calls them. The time after
    the step's last `mx.eval` returns ("gb.after_wait") is `.tolist()` and the per-sequence loop."""
    G = importlib.import_module("mlx_lm.generate")  # the package re-exports a function `generate`

    def wrap_gb_next(real: Callable) -> Callable:
        def next_(batch: Any) -> Any:
            t0 = rec.last_eval_end = pc()
            try:
                return real(batch)
            finally:
                t1 = pc()
                rec.add("gb.next", t1 - t0)
                if rec.last_eval_end > t0:
                    rec.add("gb.after_wait", t1 - rec.last_eval_end)
        return next_

    real_mx = G.mx
    G.mx = _TimedMx(rec)
    try:
        with patched([(G.GenerationBatch, "next", wrap_gb_next)]), timers(rec, [(G.GenerationBatch, "filter", "gb.filter")]):
            yield
    finally:
        G.mx = real_mx


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
    ("sampler graph, list(logprobs) (before the launch)", False,
     lambda p: _g(p, "gb.next", "gb.after_wait", "model_build", "mx.async_eval", "mx.eval")),
    ("kernel launch (mx.async_eval)", False, lambda p: _g(p, "mx.async_eval")),
    ("wait for the previous step (mx.eval)", False, lambda p: _g(p, "mx.eval")),
    (".tolist(), per-sequence loop: max_tokens, stop matchers, Response objects", False,
     lambda p: _g(p, "gb.after_wait", "gb.filter")),
    ("BatchGenerator._next bookkeeping", False, lambda p: _g(p, "bg.next", "gb.next")),
    ("= BatchGenerator.next()", False, lambda p: _g(p, "bg.next")),
    ("runner: uid mapping, Generated objects", True, lambda p: _g(p, "runner.step", "bg.next")),
    ("detokenization (add_token of the engine's detokenizer)", True, lambda p: _g(p, "detok.add_token")),
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
