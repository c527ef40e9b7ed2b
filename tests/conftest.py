from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# Tests mirror the source rooms (tests/engine/, tests/api/, ...) and share helpers by module name
# (`from test_step_runner import drive`): every room's folder is importable from every other, as
# the top level is, whatever order pytest collects them in.
for _room in sorted(p for p in Path(__file__).resolve().parent.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
    sys.path.append(str(_room))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
