"""The own step's CPU/GPU differences are one record (engine/step/backend.py), chosen once: the step
itself never asks which device it is on."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

from engine.step import step_runner
from engine.step.backend import CPU, GPU, step_backend


def test_the_record_for_each_device() -> None:
    assert step_backend(on_cpu=True, flat_supported=True) == CPU
    assert not step_backend(on_cpu=True, flat_supported=False).flat  # the model's attention decides
    assert step_backend(on_cpu=False, flat_supported=True) == GPU and not GPU.flat
    # Every field says something the two do differently.
    same = [f.name for f in fields(CPU) if getattr(CPU, f.name) == getattr(GPU, f.name)]
    assert same == []


def test_the_step_reads_the_record_and_not_the_device() -> None:
    """Outside `StepRunner.__init__` (which picks the record) no `on_cpu` and no device query."""
    tree = ast.parse(Path(step_runner.__file__).read_text())
    init = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    inside = {id(n) for n in ast.walk(init)}
    found = [f"line {n.lineno}: {ast.unparse(n)}" for n in ast.walk(tree) if id(n) not in inside and (
        (isinstance(n, ast.Name) and n.id in ("on_cpu", "_on_cpu"))
        or (isinstance(n, ast.Attribute) and n.attr in ("on_cpu", "_on_cpu", "default_device")))]
    assert not found, "\n".join(found)
