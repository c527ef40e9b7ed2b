"""The service's server is what the rooms below it declare they need: every member of the route
hosts (api/core/dialect.py, api/responses/routes.py) and of the pipeline's host
(api/core/generation.py) exists on a real `OpenAIServer`, and its settings carry what the
settings protocols read. Checked on the objects (no type checker runs here), so renaming a member on
one side fails here rather than on the first request of that route."""

from __future__ import annotations

from typing import Any, Protocol

import pytest

from api.core.dialect import RouteHost, RouteSettings
from api.core.generation import Host
from api.responses.routes import ResponsesHost, ResponsesSettings
from api.service.server import OpenAIServer
from api.service.settings import AppSettings


def members(protocol: type) -> set[str]:
    """A protocol's own members: annotated attributes, methods and properties, over its bases."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls in (Protocol, object) or not getattr(cls, "_is_protocol", False):
            continue
        names |= set(getattr(cls, "__annotations__", {}))
        names |= {n for n in vars(cls) if not n.startswith("_")}
    return names


class NoReplica:
    def stream(self, *args: Any) -> Any:
        raise AssertionError("not called")

    async def info(self) -> dict[str, Any]:
        raise RuntimeError("no replica")

    async def stats(self) -> dict[str, Any]:
        return {}


@pytest.mark.parametrize("protocol", [RouteHost, ResponsesHost, Host])
def test_the_server_has_every_member_its_hosts_declare(protocol: type) -> None:
    server = OpenAIServer(AppSettings.from_args({"model": "m"}), NoReplica(), load_tokenizer=lambda: None)
    assert members(protocol), protocol
    assert [n for n in sorted(members(protocol)) if not hasattr(server, n)] == []


@pytest.mark.parametrize("protocol", [RouteSettings, ResponsesSettings])
def test_the_settings_have_every_member_the_routes_read(protocol: type) -> None:
    settings = AppSettings.from_args({"model": "m"})
    assert [n for n in sorted(members(protocol)) if not hasattr(settings, n)] == []
