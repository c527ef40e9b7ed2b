"""Several models in one app: the `models:` list of serve_config.yaml's `args:` (no Ray here).

Each entry names a model and may override, for that model only, `served_model_name`, `model_aliases`,
`tool_parser`, `engine` (merged key by key over the app's `engine`, `cache` included) and
`llm_server` (its replicas' resources: `resources: {pomona_host_mac2: 1}` pins it to a host,
`memory_bytes` asks Ray for the memory it needs). Every other setting is the app's, shared.

The prefix cache's RAM budget is shared by the models of the app: an entry without its own
`engine.cache.ram_bytes` gets the app's `ram_fraction` divided by the number of models, so N models
on one Mac together take what one model would. Entries on the SSD are keyed by each model's
fingerprint, so models never read each other's caches even in a shared `ssd_dir`.

An entry with `multiplexed: true` is not pinned to replicas of its own: all such models share one
deployment (deployments/multiplexed.py) whose replicas each keep up to
`multiplex.max_models_per_replica` of them loaded (Ray Serve model multiplexing, least recently used
out first); `multiplex.llm_server` overrides the app's `llm_server` for those replicas and
`multiplex.load_wait_s` bounds how long a request waits for its model to load before a 503.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Mapping

from api.service.settings import AppSettings, ReplicaSettings

PER_MODEL = frozenset({"model", "served_model_name", "model_aliases", "tool_parser", "engine", "llm_server",
                       "multiplexed"})
DEFAULT_RAM_FRACTION = 0.1  # cache_tiers.config.CacheConfig's default


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) else value
    return out


def _entry(args: Mapping[str, Any], item: Any, count: int, where: str) -> dict[str, Any]:
    if isinstance(item, str):
        item = {"model": item}
    if not isinstance(item, Mapping) or "model" not in item:
        raise ValueError(f"{where} must be a model id/path or a mapping with 'model'")
    unknown = set(item) - PER_MODEL
    if unknown:
        raise ValueError(f"{where}: unknown per-model settings {sorted(unknown)}; known: {sorted(PER_MODEL)}")
    merged = {**args, **{k: v for k, v in item.items() if k not in ("engine", "llm_server", "multiplexed")}}
    for key in ("engine", "llm_server"):
        merged[key] = _merge(args.get(key) or {}, item.get(key) or {})
    cache = dict(merged["engine"].get("cache") or {})
    if count > 1 and cache.get("ram_bytes") is None and "ram_fraction" not in (item.get("engine") or {}).get("cache", {}):
        cache["ram_fraction"] = float(cache.get("ram_fraction", DEFAULT_RAM_FRACTION)) / count
        merged["engine"] = {**merged["engine"], "cache": cache}
    merged["engine"].pop("model", None)  # each entry's own `model`
    return merged


@dataclass(frozen=True)
class Multiplex:
    max_models_per_replica: int = 2
    load_wait_s: float = 60.0  # a request waits this long for its model to load, then gets 503 + Retry-After
    llm_server: ReplicaSettings = ReplicaSettings()

    def __post_init__(self) -> None:
        if self.max_models_per_replica < 1 or self.load_wait_s < 0:
            raise ValueError("multiplex.max_models_per_replica must be >= 1 and multiplex.load_wait_s >= 0")


@dataclass(frozen=True)
class ModelPlan:
    models: tuple[AppSettings, ...]  # every served model, in the listed order
    multiplexed: frozenset[str]  # served names held by the shared multiplexed deployment
    multiplex: Multiplex

    def pinned(self) -> list[AppSettings]:
        return [s for s in self.models if s.served_name() not in self.multiplexed]

    def shared(self) -> list[AppSettings]:
        return [s for s in self.models if s.served_name() in self.multiplexed]

    def multiplex_replicas(self) -> AppSettings:
        """The settings the shared deployment's replicas are built from (resources, drain, env)."""
        return replace(self.shared()[0], llm_server=self.multiplex.llm_server)


def plan(args: Mapping[str, Any] | None) -> ModelPlan:
    """The app's models and how each is held (its own deployment, or the shared multiplexed one)."""
    args = dict(args or {})
    block = dict(args.pop("multiplex", None) or {})
    unknown = set(block) - {"max_models_per_replica", "load_wait_s", "llm_server"}
    if unknown:
        raise ValueError(f"unknown multiplex settings: {sorted(unknown)}")
    every = model_settings(args)
    flags = [bool(item.get("multiplexed")) if isinstance(item, Mapping) else False for item in args.get("models") or ()]
    multiplexed = frozenset(s.served_name() for s, flag in zip(every, flags) if flag)
    base = dict(args.get("llm_server") or {})
    replicas = ReplicaSettings.from_dict(_merge(base, block.pop("llm_server", None) or {}), "multiplex.llm_server",
                                         num_cpus=2.0, resources={"apple_silicon": 1.0})
    return ModelPlan(tuple(every), multiplexed, Multiplex(llm_server=replicas, **block))


def model_settings(args: Mapping[str, Any] | None) -> list[AppSettings]:
    """One AppSettings per served model: the `models:` list, else the app's single `model`."""
    args = dict(args or {})
    args.pop("multiplex", None)
    items = args.pop("models", None)
    if not items:
        return [AppSettings.from_args(args)]
    if isinstance(items, (str, Mapping)):
        raise ValueError("models must be a list (of model ids/paths or mappings with 'model')")
    if "model" in args:
        raise ValueError("give either 'model' or 'models', not both")
    out = [AppSettings.from_args(_entry(args, item, len(items), f"models[{i}]")) for i, item in enumerate(items)]
    names = [s.served_name() for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"served model names must differ, got {names}; set served_model_name per entry")
    return out


def deployment_name(settings: AppSettings) -> str:
    """The LLM server deployment of one model, e.g. LLMServer-mlx-community-qwen3-4b-4bit."""
    return "LLMServer-" + re.sub(r"[^a-z0-9]+", "-", settings.served_name().lower()).strip("-")
