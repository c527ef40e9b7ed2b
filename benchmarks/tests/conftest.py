"""The harness's own checks borrow the tests' tiny random model (tests/tiny_model.py): benchmarks may
use the tests' fixtures, the tests never import benchmarks (tests/test_architecture.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
