"""Both runners satisfy the declared `Runner` protocol (engine/runner.py): every member present with
a compatible signature (checked on the classes with `inspect`), and `isinstance` on real instances
(the protocol is `runtime_checkable`), so the engine can hold either behind the one seam."""

from __future__ import annotations

import inspect
from typing import Any

import mlx_lm
import pytest

from engine.batch_generator import BatchGeneratorRunner
from engine.config import EngineConfig
from engine.runner import Runner
from engine.runner_choice import make_runner
from engine.step.step_runner import StepRunner

RUNNERS = (StepRunner, BatchGeneratorRunner)


def protocol_members(protocol: type) -> tuple[list[str], list[str]]:
    """(attributes, methods) the protocol declares: its annotations, and the functions it defines."""
    attributes = list(protocol.__dict__.get("__annotations__", {}))
    methods = [name for name, value in vars(protocol).items()
               if inspect.isfunction(value) and (not name.startswith("_") or name == "__len__")]
    return attributes, methods


def mismatches(cls: type, protocol: type = Runner) -> list[str]:
    """What `cls` lacks of `protocol`, or declares differently. A method must take the protocol's
    parameters by the same names, kinds, defaults and annotations, in order (extra ones only with
    defaults), and return what it declares. Attributes set in `__init__` are looked for there."""
    attributes, methods = protocol_members(protocol)
    found = []
    init = inspect.getsource(cls.__init__) if "__init__" in vars(cls) else ""
    found += [f"{cls.__name__} has no attribute {a!r}" for a in attributes
              if a not in vars(cls) and f"self.{a} " not in init and f"self.{a}:" not in init]
    for name in methods:
        impl = getattr(cls, name, None)
        if not callable(impl):
            found.append(f"{cls.__name__} has no method {name}")
            continue
        want, got = inspect.signature(getattr(protocol, name)), inspect.signature(impl)
        wanted, given = list(want.parameters.values()), list(got.parameters.values())
        for w, g in zip(wanted, given):
            if (w.name, w.kind, w.default, w.annotation) != (g.name, g.kind, g.default, g.annotation):
                found.append(f"{cls.__name__}.{name}: parameter {g} where the protocol has {w}")
        if len(given) < len(wanted):
            found.append(f"{cls.__name__}.{name} lacks {[str(w) for w in wanted[len(given):]]}")
        found += [f"{cls.__name__}.{name}: extra parameter {g} without a default" for g in given[len(wanted):]
                  if g.default is inspect.Parameter.empty and g.kind not in (g.VAR_POSITIONAL, g.VAR_KEYWORD)]
        if want.return_annotation != got.return_annotation:
            found.append(f"{cls.__name__}.{name} returns {got.return_annotation}, "
                         f"the protocol {want.return_annotation}")
    return found


@pytest.mark.parametrize("cls", RUNNERS, ids=lambda c: c.__name__)
def test_each_runner_has_every_member_of_the_protocol_with_its_signature(cls: type) -> None:
    assert not mismatches(cls), "\n".join(mismatches(cls))


def test_a_runner_missing_a_method_is_caught() -> None:
    class Partial(BatchGeneratorRunner):
        speculation = None  # as if the method were not there

        def remove(self, request_id: str) -> None:  # return_cache dropped
            pass

    found = mismatches(Partial)
    assert "Partial has no method speculation" in found
    assert any(m.startswith("Partial.remove lacks") for m in found), found


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return mlx_lm.load(str(tiny_model_dir))[0]


@pytest.mark.parametrize("engine_step", ["pomona", "mlx_lm"])
def test_make_runner_returns_an_instance_of_the_protocol(model: Any, engine_step: str) -> None:
    runner = make_runner(model, EngineConfig(model="tiny", engine_step=engine_step))
    try:
        assert type(runner) is (StepRunner if engine_step == "pomona" else BatchGeneratorRunner)
        assert isinstance(runner, Runner)
    finally:
        runner.close()
