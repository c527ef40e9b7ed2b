"""The Serve application builder: `import_path: deployments.app:build_app` in serve_config.yaml."""

from __future__ import annotations

from typing import Any

from ray.serve import Application
from ray.serve.deployment import Application as BoundDeployment

from fleet.options import with_fleet_options
from deployments.ingress import Ingress
from deployments.llm_server import LLMServer
from deployments.model_list import ModelPlan, deployment_name, plan
from api.service.settings import AppSettings


def llm_server(settings: AppSettings, name: str = "LLMServer") -> BoundDeployment:
    """One model's LLM server deployment (its own replicas, resources and placement)."""
    llm = settings.llm_server
    llm_options: dict[str, Any] = dict(name=name, num_replicas=llm.num_replicas,
                                       max_ongoing_requests=llm.max_ongoing_requests,
                                       ray_actor_options=llm.actor_options(settings.llm_env_vars()))
    # Serve kills a replica this long after asking it to stop: room for the drain plus the SSD flush.
    llm_options["graceful_shutdown_timeout_s"] = settings.drain_s + 30
    if llm.max_replicas_per_node:
        llm_options["max_replicas_per_node"] = llm.max_replicas_per_node
    llm_options = with_fleet_options(llm_options, settings.fleet, settings.engine.cache.block_size)
    return LLMServer.options(**llm_options).bind(settings)


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Build from the YAML `args:` block. Actor options are set here, not in YAML `deployments:`,
    because the BLAS preload must be added only where the library exists (static YAML cannot).
    With a `models:` list, each model gets its own LLM server deployment and one ingress routes
    by the request's `model` (deployments/model_list.py, api/service/model_front.py)."""
    models = plan(args or {})
    every = list(models.models)
    first = every[0]
    first.check_key_files()  # the ingress reads them for real, on its node
    ing = first.ingress
    ingress_options = dict(num_replicas=ing.num_replicas, max_ongoing_requests=ing.max_ongoing_requests,
                           ray_actor_options=ing.actor_options(dict(first.env)))
    if len(every) == 1 and not models.multiplexed:
        return Ingress.options(**ingress_options).bind(llm_server(first), first)
    from deployments.multi_ingress import MultiIngress

    shared = multiplexed_server(models) if models.multiplexed else None
    servers = [shared if s.served_name() in models.multiplexed else llm_server(s, deployment_name(s)) for s in every]
    return MultiIngress.options(**ingress_options).bind(servers, every, models.multiplexed)


def multiplexed_server(models: ModelPlan) -> BoundDeployment:
    """The one deployment of every `multiplexed: true` model (deployments/multiplexed.py). Serve's own
    router, not the prefix-affinity one: only it knows which replica holds which model."""
    from deployments.multiplexed import MultiplexedLLMServer

    base = models.multiplex_replicas()
    llm = base.llm_server
    options: dict[str, Any] = dict(num_replicas=llm.num_replicas, max_ongoing_requests=llm.max_ongoing_requests,
                                   ray_actor_options=llm.actor_options(base.llm_env_vars()),
                                   graceful_shutdown_timeout_s=base.drain_s + 30)
    if llm.max_replicas_per_node:
        options["max_replicas_per_node"] = llm.max_replicas_per_node
    mx = models.multiplex
    return MultiplexedLLMServer.options(**options).bind(models.shared(), mx.max_models_per_replica, mx.load_wait_s)
