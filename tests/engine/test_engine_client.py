"""Both engines keep the declared interface the replica and the engine worker use (engine/client.py):
every member the protocol names, with its parameters, on the in-process engine and on the one that
speaks for an engine in its own process."""

from __future__ import annotations

import inspect

import pytest

from deployments.engine_process import EngineProcess
from engine.client import EngineClient
from engine.loop import AsyncEngine

MEMBERS = sorted(n for n in vars(EngineClient) if not n.startswith("_"))


def _shape(obj: object) -> tuple:
    if isinstance(obj, property):
        return ("property",)
    sig = inspect.signature(obj)  # type: ignore[arg-type]
    return (inspect.iscoroutinefunction(obj) or inspect.isasyncgenfunction(obj),
            [(p.name, p.kind, p.default) for p in sig.parameters.values()])


def test_the_protocol_names_what_the_host_uses():
    assert {"stream", "abort", "stats", "ready", "wait_ready", "shutdown", "held_prefixes"} <= set(MEMBERS)
    assert set(EngineClient.__annotations__) == {"model_name", "context_length"}


@pytest.mark.parametrize("cls", [AsyncEngine, EngineProcess])
@pytest.mark.parametrize("name", MEMBERS)
def test_each_engine_keeps_the_protocol(cls, name):
    assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
    declared, actual = _shape(vars(EngineClient)[name]), _shape(getattr(cls, name))
    if declared[0] == "property":
        assert actual == declared, f"{cls.__name__}.{name} is not a property"
        return
    # The protocol's bodies are stubs, so only names, kinds and defaults are compared (async-ness of a
    # stream differs by design: an async generator satisfies a function returning an AsyncIterator).
    assert actual[1] == declared[1], f"{cls.__name__}.{name}{actual[1]} is not {declared[1]}"
