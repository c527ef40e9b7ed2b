"""The `fleet:` block of serve_config.yaml's args: request routing and replica autoscaling (no Ray here).

Kept apart from `llm_server:` (resources of one replica) because these describe the set of
replicas: how requests are spread over them and how many there may be.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

ROUTERS = ("affinity", "default")


@dataclass(frozen=True)
class FleetSettings:
    router: str = "default"  # "affinity": fleet/router.py; "default": Serve's power of two choices
    saturation: int = 4  # affinity: in-flight requests at which a replica may be passed over ...
    imbalance: int = 2  # ... when it also has this many more than the least loaded replica
    stats_period_s: float = 1.0  # how often replicas report their load and cached prefix blocks
    min_replicas: int | None = None  # both set: autoscale between them instead of num_replicas
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0  # autoscaling target per replica

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"fleet.router must be one of {ROUTERS}, not {self.router!r}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("fleet.min_replicas and fleet.max_replicas go together")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.max_replicas:  # type: ignore[operator]
            raise ValueError("need 0 <= fleet.min_replicas <= fleet.max_replicas")
        if self.stats_period_s <= 0 or self.saturation < 1 or self.imbalance < 0:
            raise ValueError("fleet.stats_period_s must be > 0, saturation >= 1, imbalance >= 0")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "FleetSettings":
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown fleet settings: {sorted(unknown)}; known: {sorted(known)}")
        return cls(**values)

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None
