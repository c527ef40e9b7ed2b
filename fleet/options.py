"""Ray Serve options of the LLM server fleet: the request router and the autoscaling bounds."""

from __future__ import annotations

from typing import Any, Mapping

from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from fleet.settings import FleetSettings

ROUTER_CLASS = "fleet.router:PrefixAffinityRouter"
LOAD_ROUTER_CLASS = "fleet.router:LoadRouter"  # "default": Serve's policy, plus step-channel pinning


def router_config(fleet: FleetSettings, block_size: int) -> RequestRouterConfig:
    """Both routers get the same stats period, so a comparison differs only in the policy."""
    if fleet.router == "affinity":
        return RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={"saturation": fleet.saturation, "imbalance": fleet.imbalance,
                                   "block_size": block_size},
            request_routing_stats_period_s=fleet.stats_period_s)
    if fleet == FleetSettings():  # no fleet block: Serve's stats period (no prefix reports needed)
        return RequestRouterConfig(request_router_class=LOAD_ROUTER_CLASS)
    return RequestRouterConfig(request_router_class=LOAD_ROUTER_CLASS,
                               request_routing_stats_period_s=fleet.stats_period_s)


def with_fleet_options(options: Mapping[str, Any], fleet: FleetSettings, block_size: int) -> dict[str, Any]:
    """`LLMServer.options(...)` arguments plus routing and, when bounded, autoscaling (which
    replaces a fixed `num_replicas`: Serve refuses both)."""
    out = dict(options)
    # Always one of ours: the step channels (deployments/channels.py) need their calls pinned.
    out["request_router_config"] = router_config(fleet, block_size)
    if fleet.autoscaling:
        out.pop("num_replicas", None)
        out["autoscaling_config"] = AutoscalingConfig(
            min_replicas=fleet.min_replicas, max_replicas=fleet.max_replicas,
            initial_replicas=max(fleet.min_replicas or 0, 1),
            target_ongoing_requests=fleet.target_ongoing_requests)
    return out
