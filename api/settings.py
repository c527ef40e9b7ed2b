"""The application's settings: the `args:` block of serve_config.yaml, validated once (no Ray here).

Replica resources live here rather than in the YAML `deployments:` block on purpose: Serve replaces a
deployment's whole `ray_actor_options` with the YAML one, which would drop the BLAS preload that the
app builder adds to the LLM server's runtime environment on Linux.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from engine.config import EngineConfig

from fleet.settings import FleetSettings
from api.openai_types import Limits
from api.response_store import ResponseStoreSettings

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
APPLE_SILICON_RESOURCE = "apple_silicon"
API_KEYS_ENV = "POMONA_API_KEYS"


def _known(cls: type, values: Mapping[str, Any], where: str) -> dict[str, Any]:
    values = dict(values or {})
    unknown = set(values) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"unknown {where} settings: {sorted(unknown)}; known: {sorted(f.name for f in fields(cls))}")
    return values


@dataclass(frozen=True)
class ReplicaSettings:
    """Resources of one deployment's replicas (Ray actor options), plus Serve's queue bounds."""

    num_replicas: int = 1
    num_cpus: float = 1.0
    memory_bytes: int | None = None
    resources: tuple[tuple[str, float], ...] = ()
    max_ongoing_requests: int = 1000
    max_replicas_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.num_replicas < 1 or self.num_cpus < 0 or self.max_ongoing_requests < 1:
            raise ValueError("num_replicas and max_ongoing_requests must be >= 1, num_cpus >= 0")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None, where: str, **defaults: Any) -> "ReplicaSettings":
        merged = {**defaults, **_known(cls, values or {}, where)}
        if isinstance(merged.get("resources"), Mapping):
            merged["resources"] = tuple(sorted((str(k), float(v)) for k, v in merged["resources"].items()))
        return cls(**merged)

    def actor_options(self, env_vars: Mapping[str, str] | None = None) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.resources:
            options["resources"] = dict(self.resources)
        if self.memory_bytes:
            options["memory"] = self.memory_bytes
        if env_vars:
            options["runtime_env"] = {"env_vars": dict(env_vars)}
        return options


@dataclass(frozen=True)
class AppSettings:
    model: str = "default"
    served_model_name: str | None = None  # None: the model's directory name, or `model` itself
    api_keys: tuple[str, ...] = ()
    api_keys_file: str | None = None
    limits: Limits = Limits()
    engine: EngineConfig = EngineConfig()
    llm_server: ReplicaSettings = ReplicaSettings()
    ingress: ReplicaSettings = ReplicaSettings()
    fleet: FleetSettings = FleetSettings()  # routing over replicas and autoscaling (fleet/options.py)
    blas_preload: str | None = "auto"  # "auto": OpenBLAS on Linux when installed; a path; or null
    drain_s: float = 30.0
    # Stream items/s each LLM server replica sends through Ray Serve, all streams together
    # (deployments/engine_host.py StreamPacing); 0 sends one item per engine step per request.
    stream_items_per_s: float = 1000.0
    # One Ray item per engine step from each LLM server replica to each ingress replica, carrying every
    # request's events (deployments/channels.py); false: one Ray stream item per request per send.
    step_channel: bool = True
    # The engine in a process of its own beside each LLM server replica (deployments/engine_process.py):
    # its MLX thread then shares no interpreter with Ray Serve's threads; false: in the replica.
    engine_process: bool = True
    responses: ResponseStoreSettings = ResponseStoreSettings()  # /v1/responses store (api/response_store.py)
    tool_parser: str | None = None  # an mlx_lm.tool_parsers module name; None: the model's own, else the fallback
    # Other names clients may send as `model` for the served model: exact names or fnmatch patterns
    # ("claude-*"); agent clients send their vendor's model names and cannot all be told another.
    model_aliases: tuple[str, ...] = ()
    # Environment of every replica (LLM servers and ingress), e.g. HF_HOME, HF_ENDPOINT, HF_HUB_OFFLINE for hub
    # models. Keep secrets such as HF_TOKEN out of YAML: set them in the environment of `pomona node start`.
    env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None) -> "AppSettings":
        values = _known(cls, args or {}, "app (args:)")
        model = str(values.pop("model", "default"))
        engine = dict(values.pop("engine", {}) or {})
        engine.setdefault("model", model)
        values["engine"] = EngineConfig.from_dict(engine)
        values["limits"] = Limits.from_dict(values.get("limits"))
        values["llm_server"] = ReplicaSettings.from_dict(
            values.get("llm_server"), "llm_server", num_cpus=2.0, resources={APPLE_SILICON_RESOURCE: 1.0})
        values["ingress"] = ReplicaSettings.from_dict(values.get("ingress"), "ingress", num_cpus=0.0)
        values["fleet"] = FleetSettings.from_dict(values.get("fleet"))
        values["responses"] = ResponseStoreSettings.from_dict(values.get("responses"))
        keys = values.get("api_keys") or ()
        if isinstance(keys, str) or not all(isinstance(k, str) and k for k in keys):
            raise ValueError("api_keys must be a list of non-empty strings")
        values["api_keys"] = tuple(keys)
        aliases = values.get("model_aliases") or ()
        if isinstance(aliases, str) or not all(isinstance(a, str) and a for a in aliases):
            raise ValueError("model_aliases must be a list of non-empty strings (names or patterns like 'claude-*')")
        values["model_aliases"] = tuple(aliases)
        env = values.get("env") or {}
        if not isinstance(env, Mapping) or not all(isinstance(k, str) and k for k in env):
            raise ValueError("env must be a mapping of environment variable names to values")
        values["env"] = tuple(sorted((k, str(v)) for k, v in env.items()))
        return cls(model=model, **values)

    def is_alias(self, name: str) -> bool:
        """Whether `name` is one of `model_aliases` (case-sensitive, `*` `?` `[...]` as in fnmatch)."""
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.model_aliases)

    def served_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        path = Path(os.path.expanduser(self.model))
        # A hub id is served under its repo id; a pinned revision (`@...`) is a detail of the deployment.
        return path.name if path.is_dir() else self.model.partition("@")[0]

    def all_api_keys(self, environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
        """Keys from config, the POMONA_API_KEYS environment variable (comma-separated) and the key file."""
        keys = list(self.api_keys)
        keys += [k.strip() for k in environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
        if self.api_keys_file:
            text = Path(os.path.expanduser(self.api_keys_file)).read_text(encoding="utf-8")
            keys += [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
        return tuple(dict.fromkeys(keys))

    def llm_env_vars(self, platform: str = sys.platform) -> dict[str, str]:
        """Environment for the LLM server: `env`, plus the BLAS preload only where it exists (static YAML cannot)."""
        env = dict(self.env)
        if self.blas_preload is None:
            return env
        path = OPENBLAS if self.blas_preload == "auto" else self.blas_preload
        if self.blas_preload == "auto" and not platform.startswith("linux"):
            return env
        return {**env, "LD_PRELOAD": path} if os.path.exists(path) else env
