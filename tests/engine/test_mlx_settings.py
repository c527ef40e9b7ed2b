"""engine/mlx_settings.py: MLX switches chosen per backend, set before the first forward."""

from __future__ import annotations

import pytest

from engine import mlx_settings
from engine.config import EngineConfig
from engine.mlx_settings import CUDNN_SDPA_ENV


def test_auto_turns_cudnn_attention_off_on_cuda_only() -> None:
    env: dict[str, str] = {}
    assert mlx_settings.apply(EngineConfig(), cuda=True, environ=env) == {CUDNN_SDPA_ENV: "0"}
    assert env == {CUDNN_SDPA_ENV: "0"}
    env = {}
    assert mlx_settings.apply(EngineConfig(), cuda=False, environ=env) == {} and env == {}


def test_true_keeps_cudnn_and_false_turns_it_off() -> None:
    env: dict[str, str] = {}
    mlx_settings.apply(EngineConfig(cudnn_attention=True), cuda=True, environ=env)
    assert env == {}
    mlx_settings.apply(EngineConfig(cudnn_attention=False), cuda=True, environ=env)
    assert env == {CUDNN_SDPA_ENV: "0"}


def test_a_value_the_user_exported_is_kept() -> None:
    env = {CUDNN_SDPA_ENV: "1"}
    assert mlx_settings.apply(EngineConfig(), cuda=True, environ=env) == {}
    assert env == {CUDNN_SDPA_ENV: "1"}


def test_the_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="cudnn_attention"):
        EngineConfig(cudnn_attention="sometimes")
    assert EngineConfig.from_dict({"cudnn_attention": False}).cudnn_attention is False


def test_this_cpu_sets_nothing() -> None:
    assert not mlx_settings.cuda_backend()
    assert mlx_settings.apply(EngineConfig(), environ={}) == {}
