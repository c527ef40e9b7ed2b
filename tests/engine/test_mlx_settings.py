"""engine/mlx_settings.py: MLX switches chosen per backend, set before the first forward."""

from __future__ import annotations

import pytest

import mlx.core as mx

from engine import mlx_settings
from engine.config import EngineConfig
from engine.mlx_settings import CPU_CACHE_LIMIT, CUDNN_SDPA_ENV


@pytest.fixture(autouse=True)
def _keep_mlx_cache_limit():
    """`apply` sets MLX's process-wide buffer cache limit: every test here leaves it as it found it."""
    before = mx.set_cache_limit(0)
    mx.set_cache_limit(before)
    yield
    mx.set_cache_limit(before)


def _limit_now() -> int:
    now = mx.set_cache_limit(0)
    mx.set_cache_limit(now)
    return now


def test_auto_turns_cudnn_attention_off_on_cuda_only() -> None:
    env: dict[str, str] = {}
    assert mlx_settings.apply(EngineConfig(), cuda=True, environ=env, on_cpu=False) == {CUDNN_SDPA_ENV: "0"}
    assert env == {CUDNN_SDPA_ENV: "0"}
    env = {}
    assert mlx_settings.apply(EngineConfig(), cuda=False, environ=env, on_cpu=False) == {} and env == {}


def test_true_keeps_cudnn_and_false_turns_it_off() -> None:
    env: dict[str, str] = {}
    mlx_settings.apply(EngineConfig(cudnn_attention=True), cuda=True, environ=env)
    assert env == {}
    mlx_settings.apply(EngineConfig(cudnn_attention=False), cuda=True, environ=env)
    assert env == {CUDNN_SDPA_ENV: "0"}


def test_a_value_the_user_exported_is_kept() -> None:
    env = {CUDNN_SDPA_ENV: "1"}
    assert mlx_settings.apply(EngineConfig(), cuda=True, environ=env, on_cpu=False) == {}
    assert env == {CUDNN_SDPA_ENV: "1"}


def test_the_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="cudnn_attention"):
        EngineConfig(cudnn_attention="sometimes")
    assert EngineConfig.from_dict({"cudnn_attention": False}).cudnn_attention is False


def test_this_cpu_keeps_freed_buffers_up_to_the_cpu_limit_and_sets_no_switch() -> None:
    """MLX's CPU default (32 MiB) returns a prompt chunk's attention scores to the OS in every
    layer; "auto" keeps them on the CPU backend, and the engine applies it when it starts."""
    assert not mlx_settings.cuda_backend() and mlx_settings.cpu_backend()
    mx.set_cache_limit(32 << 20)
    env: dict[str, str] = {}
    assert mlx_settings.apply(EngineConfig(), environ=env) == {"cache_limit": str(CPU_CACHE_LIMIT)}
    assert env == {} and _limit_now() == CPU_CACHE_LIMIT


def test_gpus_keep_mlx_cache_limit_unless_a_number_is_given() -> None:
    mx.set_cache_limit(12345)
    assert mlx_settings.apply(EngineConfig(), cuda=True, environ={CUDNN_SDPA_ENV: "1"}, on_cpu=False) == {}
    assert _limit_now() == 12345
    mlx_settings.apply(EngineConfig(mlx_cache_limit=1 << 20), cuda=False, environ={}, on_cpu=False)
    assert _limit_now() == 1 << 20
    mlx_settings.apply(EngineConfig(mlx_cache_limit=None), cuda=False, environ={}, on_cpu=True)
    assert _limit_now() == 1 << 20  # null: MLX's own, left alone even on the CPU


def test_the_cache_limit_setting_is_checked() -> None:
    for bad in (-1, "lots", 1.5, True):
        with pytest.raises(ValueError, match="mlx_cache_limit"):
            EngineConfig(mlx_cache_limit=bad)
    assert EngineConfig.from_dict({"mlx_cache_limit": None}).mlx_cache_limit is None


def test_an_engine_applies_the_cache_limit_when_it_starts(tiny_model_dir) -> None:
    from engine_helpers import make_engine, run

    mx.set_cache_limit(32 << 20)
    engine = make_engine(tiny_model_dir)
    try:
        assert _limit_now() == CPU_CACHE_LIMIT
    finally:
        run(engine.shutdown())
