"""Whether a prefix the SSD holds is read back or computed again: by the rates this engine measured.

Why: reading a prefix back is not always cheaper than computing it. On a Mac (a prefill of a few
thousand tokens a second, an SSD of several GB/s) it nearly always is; on a fast GPU serving a
small model it was not (H200, the smollm2 shape, a 15,000-token prompt after a restart: the SSD hit
1,085 ms, the same prompt cold 458 ms; docs/accelerators.md, session 21), and an SSD directory on a
slow disk (a network share, a USB drive) can lose anywhere. So the engine keeps two rates, both
as its requests saw them, and reads a prefix only while reading was not clearly slower:

- a read: from the request's first lookup to its blocks held in RAM (the reader thread's disk read
  and parse, then the hand-over into MLX arrays, spread over steps while others run), per token read;
- a prefill: from a request's admission to its first token, per token it prefilled (other prompts
  prefilled beside it and the decode rows of its steps included: what computing cost a request).

A read is chosen while it is at most `margin` times the prefill's cost per token (a read also spares
every running request the compute) or either rate is unknown; when it is declined, every
`explore_every`-th decline reads anyway, so a disk that got faster (a warm page cache) is seen
again. Both rates are exponential averages, so a few slow samples do not decide for good.

The rates outlive the process in a small JSON file in the SSD directory, per model fingerprint
(`rates_file`): the SSD's hits come mostly right after a restart, when nothing would be measured yet.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Samples of fewer tokens are not rates: a step's fixed cost dominates a short prefill or read.
MIN_SAMPLE_TOKENS = 256
EMA_WEIGHT = 0.3  # of a new sample


@dataclass(frozen=True)
class RestoreChoiceConfig:
    margin: float = 1.5
    explore_every: int = 8


@dataclass
class _Rate:
    """Seconds per token, an exponential average of samples (None until the first)."""

    s_per_token: float | None = None
    samples: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        if tokens < MIN_SAMPLE_TOKENS or seconds <= 0:
            return
        value = seconds / tokens
        self.s_per_token = value if self.s_per_token is None else \
            (1 - EMA_WEIGHT) * self.s_per_token + EMA_WEIGHT * value
        self.samples += 1


@dataclass
class RestoreChoice:
    """The engine's record of what reads and prefills cost, and the choice it makes from it.
    Used on the MLX thread only (the engine's `_find` and its step's updates)."""

    config: RestoreChoiceConfig = field(default_factory=RestoreChoiceConfig)
    enabled: bool = True  # false (`cache.ssd_reads: always`): every SSD hit is read, as before
    read: _Rate = field(default_factory=_Rate)
    prefill: _Rate = field(default_factory=_Rate)
    declined: int = 0  # SSD hits computed again instead
    explored: int = 0  # declines turned into reads to measure the disk again
    _declines_in_row: int = 0

    def record_read(self, tokens: int, seconds: float) -> None:
        self.read.add(tokens, seconds)

    def record_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill.add(tokens, seconds)

    def should_read(self) -> bool:
        """Whether the SSD hit at hand is read (True) or computed again."""
        read, prefill = self.read.s_per_token, self.prefill.s_per_token
        if not self.enabled or read is None or prefill is None or read <= self.config.margin * prefill:
            self._declines_in_row = 0
            return True
        self._declines_in_row += 1
        if self._declines_in_row >= self.config.explore_every:
            self._declines_in_row = 0
            self.explored += 1
            return True
        self.declined += 1
        return False

    def load(self, path: str | Path) -> None:
        """Start from the rates a previous run saved at `path` (missing or unreadable: from nothing)."""
        try:
            saved = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return
        for rate, key in ((self.read, "read_s_per_token"), (self.prefill, "prefill_s_per_token")):
            value = saved.get(key) if isinstance(saved, dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                rate.s_per_token, rate.samples = float(value), 0

    def save(self, path: str | Path) -> None:
        """Keep the rates at `path` for the next run (written whole, then renamed into place)."""
        target = Path(path)
        data = {"read_s_per_token": self.read.s_per_token, "prefill_s_per_token": self.prefill.s_per_token}
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".rates-")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, target)
        except OSError as e:  # a cache directory gone or read-only costs the next run its head start only
            log.warning("could not keep the SSD read rates at %s: %s", target, e)

    def as_dict(self) -> dict[str, Any]:
        ms = (lambda r: None if r.s_per_token is None else round(r.s_per_token * 1e3, 4))
        return {"enabled": self.enabled, "read_ms_per_token": ms(self.read), "reads_measured": self.read.samples,
                "prefill_ms_per_token": ms(self.prefill), "prefills_measured": self.prefill.samples,
                "declined": self.declined, "explored": self.explored}


def rates_file(ssd_dir: str | None, fingerprint: str) -> Path | None:
    """Where a model's rates are kept: beside its SSD tier's files (None: no SSD tier, nothing to keep)."""
    if not ssd_dir:
        return None
    digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]  # a fingerprint may hold any character
    return Path(ssd_dir) / f"read-rates-{digest}.json"
