"""Several models in one app: the `models:` list of serve_config.yaml's `args:` (no Ray here).

Each entry names a model and may override, for that model only, `served_model_name`, `model_aliases`,
`tool_parser`, `engine` (merged key by key over the app's `engine`, `cache` included) and
`llm_server` (its replicas' resources: `resources: {pomona_host_mac2: 1}` pins it to a host,
`memory_bytes` asks Ray for the memory it needs). Every other setting is the app's, shared.

The prefix cache's RAM budget is shared by the models of the app: an entry without its own
`engine.cache.ram_bytes` gets the app's `ram_fraction` divided by the number of models, so N models
on one Mac together take what one model would. Entries on the SSD are keyed by each model's
fingerprint, so models never read each other's caches even in a shared `ssd_dir`.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from deployments.settings import AppSettings

PER_MODEL = frozenset({"model", "served_model_name", "model_aliases", "tool_parser", "engine", "llm_server"})
DEFAULT_RAM_FRACTION = 0.1  # engine.config.CacheConfig's default


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
    merged = {**args, **{k: v for k, v in item.items() if k not in ("engine", "llm_server")}}
    for key in ("engine", "llm_server"):
        merged[key] = _merge(args.get(key) or {}, item.get(key) or {})
    cache = dict(merged["engine"].get("cache") or {})
    if count > 1 and cache.get("ram_bytes") is None and "ram_fraction" not in (item.get("engine") or {}).get("cache", {}):
        cache["ram_fraction"] = float(cache.get("ram_fraction", DEFAULT_RAM_FRACTION)) / count
        merged["engine"] = {**merged["engine"], "cache": cache}
    merged["engine"].pop("model", None)  # each entry's own `model`
    return merged


def model_settings(args: Mapping[str, Any] | None) -> list[AppSettings]:
    """One AppSettings per served model: the `models:` list, else the app's single `model`."""
    args = dict(args or {})
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
