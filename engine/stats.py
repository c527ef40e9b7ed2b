"""Engine counters: cheap to update every step, read as a plain dict by the HTTP layer."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import psutil

WINDOW_S = 10.0  # tokens/s is measured over this trailing window


@dataclass
class EngineStats:
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished: dict[str, int] = field(default_factory=lambda: collections.Counter())
    requests_rejected: int = 0
    faults: int = 0
    direct_first_tokens: int = 0  # prefix hits whose first token came from a prefill outside the batch
    steps: int = 0
    step_time_ema_ms: float = 0.0
    max_decode_stall_ms: float = 0.0  # longest step while sequences were decoding
    # Engine-side latency sums (seconds, from arrival at the engine): compared with the ingress's
    # TTFT histogram they split a slow first token into engine time and serving-stack time.
    first_tokens: int = 0
    ttft_seconds_sum: float = 0.0
    queue_seconds_sum: float = 0.0
    _window: collections.deque = field(default_factory=collections.deque, repr=False)

    def record_step(self, seconds: float, generated: int, decoding: bool) -> None:
        self.steps += 1
        ms = seconds * 1000.0
        self.step_time_ema_ms = ms if self.steps == 1 else 0.9 * self.step_time_ema_ms + 0.1 * ms
        if decoding:
            self.max_decode_stall_ms = max(self.max_decode_stall_ms, ms)
        self.generation_tokens_total += generated
        now = time.monotonic()
        self._window.append((now, generated))
        while self._window and now - self._window[0][0] > WINDOW_S:
            self._window.popleft()

    def record_first_token(self, ttft_s: float, queued_s: float) -> None:
        self.first_tokens += 1
        self.ttft_seconds_sum += ttft_s
        self.queue_seconds_sum += queued_s

    def tokens_per_s(self) -> float:
        if len(self._window) < 2:
            return 0.0
        span = self._window[-1][0] - self._window[0][0]
        return sum(n for _, n in list(self._window)[1:]) / span if span > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens_total": self.prompt_tokens_total,
            "cached_tokens_total": self.cached_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "requests_finished": dict(self.requests_finished),
            "requests_rejected": self.requests_rejected,
            "faults": self.faults,
            "direct_first_tokens": self.direct_first_tokens,
            "first_tokens": self.first_tokens,
            "ttft_seconds_sum": round(self.ttft_seconds_sum, 6),
            "queue_seconds_sum": round(self.queue_seconds_sum, 6),
            "steps": self.steps,
            "step_time_ms": round(self.step_time_ema_ms, 3),
            "max_decode_stall_ms": round(self.max_decode_stall_ms, 3),
            "tokens_per_s": round(self.tokens_per_s(), 3),
            "process_rss_bytes": psutil.Process().memory_info().rss,
        }


@dataclass
class ThreadTimes:
    """Where the MLX thread's time goes, summed (seconds): taking commands, engine steps (wall, and
    the thread's own CPU inside them), handing events to the event loops. Read before and after a
    load (benchmarks/harness/step_report.py) it says how long a step takes in this process, whether the
    thread was busy or waiting (for the GIL, or for the GPU where its driver waits without spinning)."""

    commands: float = 0.0
    step: float = 0.0
    step_cpu: float = 0.0
    deliver: float = 0.0

    def as_dict(self) -> dict:
        return {k: round(v, 6) for k, v in vars(self).items()}
