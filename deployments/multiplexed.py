"""Many models on little memory: one deployment whose replicas each keep a few models loaded.

Ray Serve model multiplexing does the bookkeeping: the ingress sends each request with the handle
option `multiplexed_model_id` (the served name), Serve routes it to a replica that already holds
that model when there is one, and `serve.multiplexed(max_num_models_per_replica=N)` loads it on
first use there, evicting the least recently used model (whose `__del__` drains and shuts its
engine down). Each loaded model is a whole `EngineHost` (own MLX thread, own prefix store keyed by
its fingerprint); the prefix-cache RAM fraction is already divided among the app's models.

A request whose model is still loading waits for it up to `load_wait_s`, then is refused with 503 +
Retry-After (the load goes on). `info()` answers from the model's config.json without loading it, so
the ingress's readiness polls never make a replica swap models.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, AsyncIterator

from ray import serve

from deployments.engine_host import EngineHost, StreamPacing
from api.service.model_status import ModelStatus
from api.service.settings import AppSettings

log = logging.getLogger("pomona.llm_server")


class LoadedModel:
    """One model's engine on a multiplexed replica."""

    def __init__(self, name: str, host: EngineHost, status: ModelStatus, drain_s: float,
                 loaded: dict[str, "LoadedModel"]) -> None:
        self.name, self.host, self._status, self._drain_s, self._loaded = name, host, status, drain_s, loaded
        loaded[name] = self

    async def close(self) -> None:
        self._loaded.pop(self.name, None)
        await self.host.shutdown(self._drain_s)
        self._status.set(phase="unloaded")
        self._status.stop()

    async def __del__(self) -> None:  # Serve calls it when it evicts this model (LRU)
        log.info("unloading %s (least recently used) after draining up to %.0f s", self.name, self._drain_s)
        await self.close()


@serve.deployment(name="LLMServer-multiplexed", max_ongoing_requests=1000, health_check_period_s=10,
                  health_check_timeout_s=60, graceful_shutdown_wait_loop_s=2, graceful_shutdown_timeout_s=60)
class MultiplexedLLMServer:
    def __init__(self, models: list[AppSettings], max_models_per_replica: int, load_wait_s: float) -> None:
        self._models = {s.served_name(): s for s in models}
        self._load_wait_s = load_wait_s
        self._loaded: dict[str, LoadedModel] = {}

        async def load(model_id: str) -> LoadedModel:
            return await self._load(model_id)
        # Wired at init so that the bound comes from serve_config.yaml (Serve detects it on the instance).
        self.get_model = serve.multiplexed(max_num_models_per_replica=max_models_per_replica)(load)

    def _settings(self) -> tuple[str, AppSettings]:
        name = serve.get_multiplexed_model_id()
        if name not in self._models:
            raise ValueError(f"model {name!r} is not one of this deployment's models {sorted(self._models)}")
        return name, self._models[name]

    async def _load(self, name: str) -> LoadedModel:
        settings = self._models[name]
        status = ModelStatus.on_board(name, settings.engine.model)
        try:
            await status.prepare(settings.engine.model)
            host = EngineHost(settings.engine, pacing=StreamPacing(settings.stream_items_per_s, steps=settings.stream_pacing_steps),
                                    process=settings.engine_process)
            await host.start()
        except Exception as exc:
            status.set(phase="failed", error=str(exc))
            status.stop()
            raise
        status.set(phase="ready")
        return LoadedModel(name, host, status, settings.drain_s, self._loaded)

    async def generate(self, prompt_tokens: list[int], params: dict[str, Any],
                       request_id: str) -> AsyncIterator[Any]:
        name, _ = self._settings()
        try:  # shield: a request that stops waiting does not cancel the load
            model = await (self.get_model(name) if name in self._loaded else  # loaded: marks it recently used
                           asyncio.wait_for(asyncio.shield(self.get_model(name)), self._load_wait_s))
        except asyncio.TimeoutError:
            yield {"rejected": {"kind": "closed", "retry_after_s": 5.0, "message":
                                f"The model {name!r} is being loaded on a model server replica; retry in a few seconds."}}
            return
        async for item in model.host.stream(prompt_tokens, params, request_id):
            yield item

    async def info(self) -> dict[str, Any]:
        from modelio.models import context_length_of, resolve_model

        name, settings = self._settings()
        if name in self._loaded:
            return self._loaded[name].host.info()
        path = await asyncio.to_thread(resolve_model, settings.engine.model)
        context = context_length_of(path)
        if settings.engine.max_model_len:
            context = min(context, settings.engine.max_model_len)
        return {"model": settings.engine.model, "context_length": context, "loaded": False,
                "max_tokens_limit": settings.engine.max_tokens_limit,
                "default_max_tokens": settings.engine.default_max_tokens, "pid": os.getpid()}

    def stats(self) -> dict[str, Any]:
        name, _ = self._settings()
        if name not in self._loaded:
            raise RuntimeError(f"model {name!r} is not loaded on this replica")
        return self._loaded[name].host.stats()

    async def admin(self, action: str, tier: str = "all") -> dict[str, Any]:
        name, _ = self._settings()
        if name not in self._loaded:
            return {"replica": {"pid": os.getpid()}, "model": name, "loaded": False}
        return await self._loaded[name].host.admin(action, tier)

    async def check_health(self) -> None:
        for model in list(self._loaded.values()):
            await model.host.check_health()

    async def __del__(self) -> None:
        for model in list(self._loaded.values()):
            await model.close()
