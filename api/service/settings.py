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
from api.core.fields import Limits
from api.responses.store import ResponseStoreSettings
from api.service.auth import KEY_TENANT_PREFIX, TENANT_NAME, KeyRing, key_tenant

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
APPLE_SILICON_RESOURCE = "apple_silicon"
API_KEYS_ENV = "POMONA_API_KEYS"
ADMIN_API_KEYS_ENV = "POMONA_ADMIN_API_KEYS"


class KeyConfigError(ValueError):
    """A key source is configured but yields no usable key: the app must not start (it would serve
    without the auth its operator asked for). The message says what to fix."""


def _key_list(value: Any, where: str) -> tuple[str, ...]:
    keys = value or ()
    if isinstance(keys, str) or not all(isinstance(k, str) and k.strip() for k in keys):
        raise ValueError(f"{where} must be a list of non-empty strings")
    return tuple(k.strip() for k in keys)


def read_key_file(path: str, setting: str) -> tuple[str, ...]:
    """One key per line; blank lines and `#` lines are skipped. A file with no key is an error."""
    full = Path(os.path.expanduser(path))
    try:
        text = full.read_text(encoding="utf-8")
    except OSError as exc:
        raise KeyConfigError(f"{setting} {path!r} cannot be read ({exc.strerror or exc}): create it with one key "
                             f"per line, or remove {setting} from serve_config.yaml") from None
    keys = tuple(line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#"))
    if not keys:
        raise KeyConfigError(f"{setting} {path!r} holds no key (only blank or '#' lines): add one key per line, "
                             f"or remove {setting} from serve_config.yaml to serve without those keys")
    return keys


def env_keys(name: str, environ: Mapping[str, str]) -> tuple[str, ...]:
    """Comma-separated keys from an environment variable. Set but holding no key is an error: an
    expansion of an unset variable (`POMONA_API_KEYS=$KEYS`) must not serve without keys."""
    if name not in environ:
        return ()
    keys = tuple(k.strip() for k in environ[name].split(",") if k.strip())
    if not keys:
        raise KeyConfigError(f"the environment variable {name} is set but holds no key: set it to comma-separated "
                             f"keys in the environment of `pomona node start`, or unset it")
    return keys


@dataclass(frozen=True)
class TenantKeys:
    """A named tenant (`tenants:` in serve_config.yaml): the keys of several people or agents that
    share stored responses and the prefix cache, by a name that survives key rotation."""

    name: str
    keys: tuple[str, ...] = ()
    keys_file: str | None = None

    def __post_init__(self) -> None:
        if not TENANT_NAME.match(self.name) or self.name.startswith(KEY_TENANT_PREFIX):
            raise ValueError(f"tenant name {self.name!r}: use 1-64 letters, digits, '_', '.' or '-', not starting "
                             f"with {KEY_TENANT_PREFIX!r} (those name keys listed on their own)")
        if not self.keys and not self.keys_file:
            raise KeyConfigError(f"tenant {self.name!r} has no key: give it a list of keys, or "
                                 "{keys: [...], keys_file: PATH}")

    @classmethod
    def parse(cls, name: Any, value: Any) -> "TenantKeys":
        where = f"tenants.{name}"
        if isinstance(value, Mapping):
            unknown = set(value) - {"keys", "keys_file"}
            if unknown:
                raise ValueError(f"unknown {where} settings: {sorted(unknown)}; known: ['keys', 'keys_file']")
            file = value.get("keys_file")
            if file is not None and not isinstance(file, str):
                raise ValueError(f"{where}.keys_file must be a path")
            return cls(str(name), _key_list(value.get("keys"), f"{where}.keys"), file)
        return cls(str(name), _key_list(value, where))

    def all_keys(self) -> tuple[str, ...]:
        keys = self.keys
        if self.keys_file:
            keys += read_key_file(self.keys_file, f"tenants.{self.name}.keys_file")
        return keys


@dataclass(frozen=True)
class CacheSharing:
    """`cache:` in args: the ingress's side of the prefix cache (the tiers are `engine.cache`)."""

    # Whether requests of different tenants may share cached prefixes. None (the default): only
    # when no key is configured (one implicit tenant). true: the tenant is left out of each request's
    # cache salt, so the cache, its cached-token counts and its timing are shared by all tenants.
    share_across_tenants: bool | None = None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "CacheSharing":
        values = dict(values or {})
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown cache settings: {sorted(unknown)}; known: {sorted(f.name for f in fields(cls))} "
                             "(the prefix-cache tiers are set under engine.cache)")
        share = values.get("share_across_tenants")
        if share is not None and not isinstance(share, bool):
            raise ValueError("cache.share_across_tenants must be true, false or null")
        return cls(**values)


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
    # Inference keys, each its own tenant (api/service/auth.py); POMONA_API_KEYS adds more on the ingress's node.
    api_keys: tuple[str, ...] = ()
    api_keys_file: str | None = None
    # Admin keys: /admin/* and /metrics (unless metrics_open); POMONA_ADMIN_API_KEYS adds more.
    admin_api_keys: tuple[str, ...] = ()
    admin_api_keys_file: str | None = None
    tenants: tuple[TenantKeys, ...] = ()  # named tenants, each with its inference keys
    # true: the app stops at start unless some inference key is configured (e.g. POMONA_API_KEYS
    # missing on the node that runs an ingress would otherwise serve without keys).
    api_keys_required: bool = False
    metrics_open: bool = False  # /metrics without a key (a Prometheus scraper on a trusted network)
    cache: CacheSharing = CacheSharing()
    limits: Limits = Limits()
    engine: EngineConfig = EngineConfig()
    llm_server: ReplicaSettings = ReplicaSettings()
    ingress: ReplicaSettings = ReplicaSettings()
    fleet: FleetSettings = FleetSettings()  # routing over replicas and autoscaling (fleet/options.py)
    blas_preload: str | None = "auto"  # "auto": OpenBLAS on Linux when installed; a path; or null
    drain_s: float = 30.0
    # Pacing of stream items through Ray Serve (deployments/engine_host.py StreamPacing): each stream
    # sends at most one item every `stream_pacing_steps` engine steps (by time: a client sees its
    # tokens within two steps however many streams run), and, if set, within a budget of
    # `stream_items_per_s` items/s for all streams together (the rule before; 0: no budget). Both 0:
    # one item per engine step per request.
    stream_pacing_steps: float = 2.0
    stream_items_per_s: float = 0.0
    # One Ray item per engine step from each LLM server replica to each ingress replica, carrying every
    # request's events (deployments/channels.py); false: one Ray stream item per request per send.
    step_channel: bool = True
    # The engine in a process of its own beside each LLM server replica (deployments/engine_process.py):
    # its MLX thread then shares no interpreter with Ray Serve's threads; false: in the replica.
    engine_process: bool = True
    responses: ResponseStoreSettings = ResponseStoreSettings()  # /v1/responses store (api/responses/store.py)
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
        values["api_keys"] = _key_list(values.get("api_keys"), "api_keys")
        values["admin_api_keys"] = _key_list(values.get("admin_api_keys"), "admin_api_keys")
        tenants = values.get("tenants") or {}
        if not isinstance(tenants, Mapping):
            raise ValueError("tenants must map tenant names to lists of keys, e.g. {team-a: [KEY1, KEY2]}")
        values["tenants"] = tuple(TenantKeys.parse(name, keys) for name, keys in tenants.items())
        values["cache"] = CacheSharing.from_dict(values.get("cache"))
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
        """Inference keys that are each their own tenant: from config, the POMONA_API_KEYS environment
        variable (comma-separated) and the key file. A source that is set but yields no key raises
        KeyConfigError."""
        keys = list(self.api_keys) + list(env_keys(API_KEYS_ENV, environ))
        if self.api_keys_file:
            keys += read_key_file(self.api_keys_file, "api_keys_file")
        return tuple(dict.fromkeys(keys))

    def all_admin_keys(self, environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
        keys = list(self.admin_api_keys) + list(env_keys(ADMIN_API_KEYS_ENV, environ))
        if self.admin_api_keys_file:
            keys += read_key_file(self.admin_api_keys_file, "admin_api_keys_file")
        return tuple(dict.fromkeys(keys))

    def key_ring(self, environ: Mapping[str, str] = os.environ) -> KeyRing:
        """Every key with its tenant and scopes, read where the ingress runs (its env and files).
        Raises KeyConfigError, saying what to fix, for a source that yields no key, a key given to
        two tenants, or `api_keys_required` with no inference key."""
        tenant_of: dict[str, str] = {k: key_tenant(k) for k in self.all_api_keys(environ)}
        for tenant in self.tenants:
            for key in tenant.all_keys():
                other = tenant_of.get(key)
                if other is not None and other != tenant.name:
                    where = "api_keys (or its file / POMONA_API_KEYS)" if other.startswith(KEY_TENANT_PREFIX) \
                        else f"tenant {other!r}"
                    raise KeyConfigError(f"a key of tenant {tenant.name!r} is also listed in {where}: "
                                         "give each inference key one tenant")
                tenant_of[key] = tenant.name
        if self.api_keys_required and not tenant_of:
            raise KeyConfigError("api_keys_required is true but no inference key is configured: set api_keys_file, "
                                 f"{API_KEYS_ENV} (in the environment of `pomona node start` on the ingress's node) "
                                 "or tenants:")
        return KeyRing(tenant_of, self.all_admin_keys(environ))

    def check_key_files(self) -> None:
        """At build time (`serve run` / `serve deploy`), on the machine that builds the app: a key file
        present here that holds no key stops the deploy with the message at once, rather than after
        Serve's retries of the ingress. A file absent here is read (and checked) on the ingress's node."""
        files = [(self.api_keys_file, "api_keys_file"), (self.admin_api_keys_file, "admin_api_keys_file")]
        files += [(t.keys_file, f"tenants.{t.name}.keys_file") for t in self.tenants]
        for path, setting in files:
            if path and Path(os.path.expanduser(path)).is_file():
                read_key_file(path, setting)

    def share_cache_across_tenants(self, keys: KeyRing) -> bool:
        """Whether the tenant is left out of cache salts: as configured, else only without keys."""
        share = self.cache.share_across_tenants
        return (not keys.configured) if share is None else share

    def llm_env_vars(self, platform: str = sys.platform) -> dict[str, str]:
        """Environment for the LLM server: `env`, plus the BLAS preload only where it exists (static YAML cannot)."""
        env = dict(self.env)
        if self.blas_preload is None:
            return env
        path = OPENBLAS if self.blas_preload == "auto" else self.blas_preload
        if self.blas_preload == "auto" and not platform.startswith("linux"):
            return env
        return {**env, "LD_PRELOAD": path} if os.path.exists(path) else env
