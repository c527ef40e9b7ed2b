"""`pomona node ...`: the `ray start` command it builds, without starting Ray (fast)."""

from __future__ import annotations

import json

import pytest

from deployments import cli, node


def start_cmd(*argv: str, apple: bool = False) -> list[str]:
    opts = cli.options(cli.parser().parse_args(["node", *argv]))
    return node.ray_start_command(opts, "ray", apple=apple, memory=16 * 2**30)


def resources(cmd: list[str]) -> dict[str, float]:
    return json.loads(next(a for a in cmd if a.startswith("--resources=")).split("=", 1)[1])


def test_head_on_linux_needs_the_dev_flag_for_apple_silicon():
    assert "apple_silicon" not in resources(start_cmd("start", "--head"))
    cmd = start_cmd("start", "--head", "--dev-apple-silicon", "--num-cpus", "2", "--object-store-memory", "200000000")
    assert resources(cmd)["apple_silicon"] == 1.0
    assert {"--head", "--port=6379", "--num-cpus=2", "--object-store-memory=200000000",
            "--include-dashboard=false"} <= set(cmd)
    assert any(k.startswith(node.HOST_RESOURCE_PREFIX) for k in resources(cmd))


def test_a_mac_declares_apple_silicon_itself_and_joins_by_address():
    cmd = start_cmd("join", "10.0.0.5:6379", "--host-name", "Studio.local", apple=True)
    assert resources(cmd) == {"apple_silicon": 1.0, "pomona_host_studio": 1.0}
    assert "--address=10.0.0.5:6379" in cmd and "--head" not in cmd
    assert node.is_apple_silicon("Darwin", "arm64") and not node.is_apple_silicon("Darwin", "x86_64")


def test_small_machines_get_a_small_object_store():
    assert node.object_store_size(8 * 2**30) == 8 * 2**30 // 20
    assert node.object_store_size(2**30) == node.MIN_OBJECT_STORE
    assert node.object_store_size(512 * 2**30) == node.MAX_OBJECT_STORE


def test_auth_mode_is_always_explicit():
    opts = node.NodeOptions(head=True)
    assert node.ray_env(opts, {})["RAY_AUTH_MODE"] == "disabled"
    assert node.ray_env(opts, {"RAY_AUTH_MODE": "token"})["RAY_AUTH_MODE"] == "token"
    assert node.ray_env(node.NodeOptions(head=True, auth="token"), {})["RAY_AUTH_MODE"] == "token"
    assert node.ray_env(opts, {})["RAY_worker_niceness"] == "0"  # the engine must not run at nice 15
    assert node.ray_env(opts, {"RAY_worker_niceness": "5"})["RAY_worker_niceness"] == "5"
    assert node.ray_env(opts, {})["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"  # controller CPU off the engine
    assert node.ray_env(opts, {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"})["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"


def test_haproxy_is_asked_of_serve_through_the_nodes_environment(capsys, monkeypatch):
    """`--haproxy`: Serve's controller reads RAY_SERVE_ENABLE_HA_PROXY from the node's processes'
    environment; without a haproxy binary the node is not started and the message says what to install."""
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in node.ray_env(node.NodeOptions(head=True), {})
    env = node.ray_env(node.NodeOptions(head=True, haproxy=True), {}, nofile_hard_limit=65536)
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and "RAY_SERVE_HAPROXY_MAXCONN" not in env
    # Pomona drains its own requests first: Serve's 30 s for a stopping ingress replica is not needed
    assert float(env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"]) <= 5
    # under mlx_lm's hard limit (4,096 files) HAProxy gets the connections it can open
    capped = int(node.ray_env(node.NodeOptions(head=True, haproxy=True), {}, nofile_hard_limit=4096)
                 ["RAY_SERVE_HAPROXY_MAXCONN"])
    assert 1000 < capped and 2.5 * capped + 36 <= 4096
    # two nodes on one machine: HAProxy's Prometheus and stats ports follow the node's private ports
    ported = node.ray_env(node.NodeOptions(head=True, haproxy=True, port_base=30000), {}, nofile_hard_limit=65536)
    assert {ported["RAY_SERVE_HAPROXY_METRICS_PORT"], ported["RAY_SERVE_HAPROXY_STATS_PORT"]} == {"30010", "30011"}
    assert not set(ported.values()) & {f"{30000 + i}" for i in range(2, 8)}
    assert cli.main(["node", "start", "--head", "--haproxy", "--dry-run"]) == 0
    assert "RAY_SERVE_ENABLE_HA_PROXY=1" in capsys.readouterr().out
    assert node.haproxy_binary({"RAY_SERVE_HAPROXY_BINARY_PATH": "/opt/haproxy"}) == "/opt/haproxy"
    monkeypatch.setattr(node, "haproxy_binary", lambda environ=None: None)
    monkeypatch.setattr(node, "run", lambda *a, **k: pytest.fail("ray start ran without haproxy"))
    assert node.start(node.NodeOptions(head=True, haproxy=True)) == 2
    assert "brew install haproxy" in capsys.readouterr().err


def test_dry_run_prints_the_command(capsys):
    assert cli.main(["node", "start", "--head", "--dev-apple-silicon", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("RAY_AUTH_MODE=") and "ray start" in out and "apple_silicon" in out


def test_head_and_address_are_exclusive():
    with pytest.raises(ValueError):
        node.NodeOptions(head=True, address="x:1")
    with pytest.raises(ValueError):
        node.NodeOptions(head=False)
