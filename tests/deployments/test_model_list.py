"""deployments/model_list.py: the `models:` list of serve_config.yaml (no Ray)."""

from __future__ import annotations

import pytest

from deployments.model_list import deployment_name, model_settings


def test_single_model_app_is_unchanged() -> None:
    (only,) = model_settings({"model": "default", "engine": {"max_running": 8, "prefill_batch": 4}})
    assert only.model == "default" and only.engine.max_running == 8 and only.engine.cache.ram_fraction == 0.1


def test_entries_override_engine_and_placement_and_share_the_ram_budget() -> None:
    a, b, c = model_settings({
        "engine": {"max_running": 8, "prefill_batch": 4, "cache": {"ram_fraction": 0.3, "block_size": 32}},
        "llm_server": {"num_cpus": 2, "resources": {"apple_silicon": 1}},
        "models": ["mlx-community/Qwen3-4B-4bit@abc",
                   {"model": "/models/coder", "served_model_name": "coder", "engine": {"max_running": 16},
                    "llm_server": {"resources": {"pomona_host_mac2": 1}}},
                   {"model": "default", "engine": {"cache": {"ram_fraction": 0.05}}}],
    })
    assert [s.served_name() for s in (a, b, c)] == ["mlx-community/Qwen3-4B-4bit", "coder", "default"]
    assert [s.engine.model for s in (a, b, c)] == ["mlx-community/Qwen3-4B-4bit@abc", "/models/coder", "default"]
    assert (a.engine.max_running, b.engine.max_running) == (8, 16)
    assert b.engine.cache.block_size == 32  # merged key by key, not replaced
    assert a.engine.cache.ram_fraction == pytest.approx(0.1) == b.engine.cache.ram_fraction  # 0.3 shared by 3
    assert c.engine.cache.ram_fraction == 0.05  # its own setting stands
    assert dict(b.llm_server.resources) == {"apple_silicon": 1.0, "pomona_host_mac2": 1.0}
    assert b.llm_server.num_cpus == 2
    assert deployment_name(a) == "LLMServer-mlx-community-qwen3-4b-4bit"


@pytest.mark.parametrize("args, message", [
    ({"models": ["a/b", "a/b"]}, "must differ"),
    ({"model": "x/y", "models": ["a/b"]}, "either 'model' or 'models'"),
    ({"models": [{"model": "a/b", "drain_s": 3}]}, "unknown per-model settings"),
    ({"models": [{"served_model_name": "x"}]}, "mapping with 'model'"),
    ({"models": "a/b"}, "must be a list"),
])
def test_bad_lists_are_refused(args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_settings(args)


def test_plan_splits_pinned_and_multiplexed_models() -> None:
    from deployments.model_list import plan

    p = plan({"llm_server": {"num_cpus": 2, "resources": {"apple_silicon": 1}},
              "models": [{"model": "a/chat"}, {"model": "a/small", "multiplexed": True},
                         {"model": "a/coder", "multiplexed": True}],
              "multiplex": {"max_models_per_replica": 1, "load_wait_s": 5, "llm_server": {"num_replicas": 2}}})
    assert [s.served_name() for s in p.pinned()] == ["a/chat"]
    assert [s.served_name() for s in p.shared()] == ["a/small", "a/coder"]
    assert (p.multiplex.max_models_per_replica, p.multiplex.load_wait_s) == (1, 5)
    replicas = p.multiplex_replicas().llm_server
    assert (replicas.num_replicas, replicas.num_cpus, dict(replicas.resources)) == (2, 2.0, {"apple_silicon": 1.0})
    with pytest.raises(ValueError, match="unknown multiplex settings"):
        plan({"models": ["a/b"], "multiplex": {"slots": 2}})
    with pytest.raises(ValueError, match="max_models_per_replica"):
        plan({"models": ["a/b"], "multiplex": {"max_models_per_replica": 0}})


@pytest.mark.parametrize("config", ["serve_config.yaml", "serve_config.fleet.yaml", "serve_config.models.yaml",
                                    "serve_config.rack.yaml"])
def test_shipped_configs_build(config: str) -> None:
    from pathlib import Path

    import yaml

    from deployments.app import build_app
    from deployments.model_list import plan

    app = yaml.safe_load((Path(__file__).resolve().parents[2] / config).read_text())["applications"][0]
    models = plan(app["args"])
    assert len(models.models) >= 1 and all(s.served_name() for s in models.models)
    build_app(app["args"])  # no Ray cluster needed to build
