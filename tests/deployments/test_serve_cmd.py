"""`pomona serve`'s drain config (deployments/serve_cmd.py): only Pomona's LLMServer is told to drain."""

from __future__ import annotations

from deployments.serve_cmd import DEFAULT_DRAIN_S, draining_config


def test_every_pomona_app_drains_its_llm_server_and_nothing_else_changes():
    config = {"http_options": {"port": 8000}, "applications": [
        {"name": "a", "import_path": "deployments.app:build_app", "args": {"drain_s": 5},
         "deployments": [{"name": "Ingress", "num_replicas": 2},
                         {"name": "LLMServer", "max_ongoing_requests": 9, "user_config": {"x": 1}}]},
        {"name": "b", "import_path": "deployments.app:build_app"},
        {"name": "other", "import_path": "elsewhere:app", "deployments": [{"name": "LLMServer"}]},
    ]}
    out, drain_s = draining_config(config)
    a, b, other = out["applications"]
    assert {"name": "Ingress", "num_replicas": 2} in a["deployments"]
    assert {"name": "LLMServer", "max_ongoing_requests": 9, "user_config": {"x": 1, "draining": True}} in a["deployments"]
    assert b["deployments"] == [{"name": "LLMServer", "user_config": {"draining": True}}]
    assert other == config["applications"][2]  # not ours: untouched
    assert out["http_options"] == config["http_options"] and a["args"] == {"drain_s": 5}
    assert drain_s == max(5, DEFAULT_DRAIN_S)  # b runs with the default
    assert "draining" not in config["applications"][0]["deployments"][1]["user_config"]  # input not mutated


def test_a_model_list_drains_each_pinned_llm_server_deployment():
    args = {"drain_s": 4, "models": [{"model": "default", "served_model_name": "smol"},
                                     {"model": "/models/qwen", "served_model_name": "Qwen3-4B"}]}
    out, drain_s = draining_config({"applications": [{"name": "m", "import_path": "deployments.app:build_app",
                                                      "args": args}]})
    told = {d["name"]: d["user_config"] for d in out["applications"][0]["deployments"]}
    assert told == {"LLMServer-smol": {"draining": True}, "LLMServer-qwen3-4b": {"draining": True}}
    assert drain_s == 4  # drain_s is app-wide
