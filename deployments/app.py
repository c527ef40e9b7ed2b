"""The Serve application builder: `import_path: deployments.app:build_app` in serve_config.yaml."""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from deployments.fleet import with_fleet_options
from deployments.ingress import Ingress
from deployments.llm_server import LLMServer
from deployments.settings import AppSettings


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Build from the YAML `args:` block. Actor options are set here, not in YAML `deployments:`,
    because the BLAS preload must be added only where the library exists (static YAML cannot)."""
    settings = AppSettings.from_args(args or {})
    llm, ing = settings.llm_server, settings.ingress
    llm_options: dict[str, Any] = dict(num_replicas=llm.num_replicas, max_ongoing_requests=llm.max_ongoing_requests,
                                       ray_actor_options=llm.actor_options(settings.llm_env_vars()))
    # Serve kills a replica this long after asking it to stop: room for the drain plus the SSD flush.
    llm_options["graceful_shutdown_timeout_s"] = settings.drain_s + 30
    if llm.max_replicas_per_node:
        llm_options["max_replicas_per_node"] = llm.max_replicas_per_node
    llm_options = with_fleet_options(llm_options, settings.fleet, settings.engine.cache.block_size)
    server = LLMServer.options(**llm_options).bind(settings)
    return Ingress.options(num_replicas=ing.num_replicas, max_ongoing_requests=ing.max_ongoing_requests,
                           ray_actor_options=ing.actor_options(dict(settings.env))).bind(server, settings)
