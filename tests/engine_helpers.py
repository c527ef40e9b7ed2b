"""Shared helpers for engine tests: a tiny-model loader and a synchronous way to run requests."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import mlx_lm

from cache_tiers.store import NullStore
from cache_tiers.config import CacheConfig
from engine.config import EngineConfig
from engine.loop import AsyncEngine, Loaded
from engine.types import Request, SamplingParams, TokenEvent


class FaultyModel:
    """Wraps a real model and raises inside the forward pass while `armed` is set."""

    def __init__(self, model: Any) -> None:
        self.inner = model
        self.armed = False
        self.fail_after: int | None = None  # fail on the N-th forward call from now

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail_after is not None:
            self.fail_after -= 1
            if self.fail_after <= 0:
                self.fail_after, self.armed = None, True
        if self.armed:
            self.armed = False
            raise RuntimeError("injected fault")
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def tiny_loader(path: Path, wrap: Any = None):
    def load(config: EngineConfig) -> Loaded:
        model, tokenizer = mlx_lm.load(str(path))
        if wrap is not None:
            model = wrap(model)
        return Loaded(model, tokenizer, 2048, "tiny", f"tiny:{path}")

    return load


def make_engine(path: Path, store_factory=None, wrap: Any = None, **overrides: Any) -> AsyncEngine:
    overrides.setdefault("cache", CacheConfig(enabled=False))
    config = EngineConfig(model=str(path), **overrides)
    engine = AsyncEngine(config, loader=tiny_loader(path, wrap),
                         store_factory=store_factory or (lambda c, l: NullStore()))
    asyncio.run(engine.wait_ready(timeout=120))
    return engine


async def collect(engine: AsyncEngine, request: Request) -> tuple[str, list[TokenEvent]]:
    events = [e async for e in engine.generate(request)]
    return "".join(e.text for e in events), events


def request(engine: AsyncEngine, text: str, request_id: str | None = None, **params: Any) -> Request:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 16)
    kwargs = {"request_id": request_id} if request_id else {}
    return Request(tuple(engine.tokenizer.encode(text)), SamplingParams(**params), **kwargs)


def run(coro):
    return asyncio.run(coro)
