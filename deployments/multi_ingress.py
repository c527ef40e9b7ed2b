"""The ingress of an app with several models: one OpenAI app per model behind api/service/model_front.py."""

from __future__ import annotations

import functools
import logging

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp

from modelio.models import tokenizer_for
from api.service.server import OpenAIServer
from deployments.engine_host import StreamPacing
from deployments.ingress import HandleBackend, log_keys
from api.service.model_front import ModelFront
from api.service.settings import AppSettings

log = logging.getLogger("pomona.ingress")


@serve.deployment(name="Ingress", max_ongoing_requests=2000)
@serve.ingress()
class MultiIngress:
    def __init__(self, llms: list[DeploymentHandle], settings: list[AppSettings],
                 multiplexed: frozenset[str] = frozenset()) -> None:
        keys = settings[0].key_ring()  # one key set for the endpoint (env and key files of this node)
        # A multiplexed model's requests carry its name: Serve routes them to a replica holding it.
        handles = [h.options(multiplexed_model_id=s.served_name()) if s.served_name() in multiplexed else h
                   for s, h in zip(settings, llms)]
        # Step channels where the deployment has one of our routers (each model's own LLM server);
        # the multiplexed deployment routes by model with Serve's router, which cannot pin them.
        servers = [OpenAIServer(s, HandleBackend(handle, step_channels=s.step_channel and s.served_name() not in multiplexed,
                                                 pacing=StreamPacing(s.stream_items_per_s, steps=s.stream_pacing_steps)),
                                functools.partial(tokenizer_for, s.model), keys=keys)
                   for s, handle in zip(settings, handles)]
        self._front = ModelFront(servers)
        log_keys([s.served_name() for s in settings], keys)

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return self._front
