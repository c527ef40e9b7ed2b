"""The benchmark harness against a real OpenAI-compatible server (mlx_lm.server on a tiny random
model): metrics are computed, outputs are fixed-length, JSON and plots are written. No speed checks."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from benchmarks.harness import serve_bench
from benchmarks.harness.client import RequestResult, aggregate, percentile
from benchmarks.harness.workloads import TextMaker, WorkloadSpec, build


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlx_lm_server(tiny_model_dir: Path) -> Iterator[str]:
    import asyncio

    from benchmarks.harness.client import wait_ready

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", str(tiny_model_dir),
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        asyncio.run(wait_ready(f"http://127.0.0.1:{port}/v1", timeout_s=60, alive=lambda: proc.poll() is None))
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_workloads_are_seeded_and_token_exact(tiny_model_dir: Path) -> None:
    maker = TextMaker(tiny_model_dir)
    spec = WorkloadSpec("p", "prefix", num_requests=6, input_len=12, output_len=4, prefix_len=40, num_prefixes=2)
    a, b = build(spec, maker), build(spec, maker)
    assert a == b
    assert len({c.system for c in a}) == 2 and len({c.turns for c in a}) == 6
    # Re-tokenising decoded text can merge across the cut; allow a token or two of slack.
    assert all(abs(maker.count(c.system or "") - 40) <= 2 for c in a)
    mt = build(WorkloadSpec("m", "multiturn", num_requests=2, input_len=8, turns=3), maker)
    assert [len(c.turns) for c in mt] == [3, 3]


def test_aggregate_math() -> None:
    rs = [RequestResult(ok=True, conv_id=i, turn=0, start=0.0, ttft=0.1 * (i + 1), e2e=1.0,
                        itl=(0.05, 0.05), output_tokens=10, prompt_tokens=100, cached_tokens=50)
          for i in range(4)]
    rs.append(RequestResult(ok=False, conv_id=9, turn=0, start=0.0, error="boom"))
    agg = aggregate(rs, duration=2.0)
    assert agg["completed"] == 4 and agg["errors"] == 1
    assert agg["output_throughput"] == pytest.approx(20.0)
    assert agg["cached_token_share"] == pytest.approx(0.5)
    assert agg["ttft_ms"]["p50"] == pytest.approx(250.0)
    assert agg["tpot_ms"]["mean"] == pytest.approx((1.0 - 0.25) / 9 * 1000)
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)


def test_cli_against_mlx_lm_server(mlx_lm_server: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    rc = serve_bench.main(["--server", f"mlx_lm={mlx_lm_server}", "--model", str(tiny_model_dir),
                           "--tokenizer", str(tiny_model_dir), "--quick", "--concurrency", "1,4",
                           "--parts", "sweep,multiturn,rate", "--request-rate", "20", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    server = data["servers"]["mlx_lm"]
    for agg in server["sweep"].values():
        assert agg["errors"] == 0
        assert agg["usage_reported_share"] == 1.0
        # logit_bias on EOS keeps every output at exactly max_tokens
        assert agg["total_output_tokens"] == agg["completed"] * data["suite"]["random"]["output_len"]
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(agg[key]) == {"mean", "p50", "p95", "p99"}
    rate = server["rates"]["20.0"]  # Poisson arrivals: same metrics, open loop
    assert rate["errors"] == 0 and rate["request_rate"] == 20.0 and rate["completed"] > 0
    turns = server["multiturn"]["ttft_p50_ms_by_turn"]
    assert len(turns) == data["suite"]["multiturn"]["turns"]
    assert server["multiturn"]["cached_tokens"] > 0  # mlx_lm.server reuses the chat history
    assert (out / "throughput_vs_concurrency.png").stat().st_size > 0
    assert (out / "ttft_vs_concurrency.png").stat().st_size > 0


def test_the_nossd_spec_turns_only_the_ssd_tier_off(tmp_path: Path) -> None:
    """`pomona-nossd` (the SSD on/off pair in one run) keeps every other cache setting as configured."""
    import yaml

    from benchmarks.harness.pomona_server import SERVE_CONFIG
    from benchmarks.harness.side_by_side import make_spec

    base = yaml.safe_load(SERVE_CONFIG.read_text())["applications"][0]["args"]["engine"]["cache"]
    left = tmp_path / "pomona-ssd-cache" / "an-earlier-runs-entry"  # the same --out directory used again
    left.parent.mkdir()
    left.write_text("stale")
    configs = {}
    for name in ("pomona", "pomona-nossd"):
        make_spec(name, tmp_path / "model", 18000, tmp_path)
        app = yaml.safe_load((tmp_path / f"{name}_serve_config.yaml").read_text())["applications"][0]
        configs[name] = app["args"]["engine"]["cache"]
    assert configs["pomona-nossd"] == {**base, "ssd_dir": None}
    assert configs["pomona"]["ssd_dir"] == str(tmp_path / "pomona-ssd-cache")
    assert not left.exists(), "a server's SSD tier must start empty, whatever an earlier run left"
    assert {k: v for k, v in configs["pomona"].items() if k != "ssd_dir"} == \
        {k: v for k, v in base.items() if k != "ssd_dir"}


def test_a_set_spec_replaces_one_engine_setting_and_keeps_the_rest(tmp_path: Path) -> None:
    """`pomona-set:KEY=VALUE` (a default A/B'd in one run) differs from `pomona` in that setting only,
    the value read as YAML; a name without `=` is refused."""
    import pytest
    import yaml

    from benchmarks.harness.side_by_side import make_spec

    engines = {}
    for name in ("pomona", "pomona-set:prefill_chunk=512", "pomona-set:checkpoint_every=null",
                 "pomona-set:cache.ssd_write=idle"):
        spec = make_spec(name, tmp_path / "model", 18000, tmp_path)
        app = yaml.safe_load((tmp_path / f"{spec.name}_serve_config.yaml").read_text())["applications"][0]
        engine = app["args"]["engine"]
        assert engine["cache"].pop("ssd_dir") == str(tmp_path / f"{spec.name}-ssd-cache")  # each its own, fresh
        engines[name] = engine
    assert engines["pomona-set:prefill_chunk=512"] == {**engines["pomona"], "prefill_chunk": 512}
    assert engines["pomona-set:checkpoint_every=null"] == {**engines["pomona"], "checkpoint_every": None}
    assert engines["pomona-set:cache.ssd_write=idle"] == {  # a dotted key: one setting inside the block
        **engines["pomona"], "cache": {**engines["pomona"]["cache"], "ssd_write": "idle"}}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        make_spec("pomona-set:prefill_chunk", tmp_path / "model", 18000, tmp_path)


def test_the_in_process_engine_config_takes_one_cache_setting_by_a_dotted_key(tmp_path: Path) -> None:
    """`--engine cache.K=V` (agent_breakdown, prefix_part) replaces that cache setting and keeps the
    SSD directory the benchmark gave and the rest of serve_config.yaml's cache block."""
    from benchmarks.engine.engine_loop import engine_config

    base = engine_config(str(tmp_path), 4, str(tmp_path / "ssd"))
    idle = engine_config(str(tmp_path), 4, str(tmp_path / "ssd"), overrides={"cache.ssd_write": "idle", "prefill_chunk": 512})
    assert (idle.cache.ssd_write, base.cache.ssd_write) == ("idle", "through")
    assert idle.cache.ssd_dir == base.cache.ssd_dir == str(tmp_path / "ssd") and idle.prefill_chunk == 512
    assert idle.cache.block_size == base.cache.block_size and idle.cache.ram_fraction == base.cache.ram_fraction


def test_spec_replay_counts_what_the_engine_proposes_and_accepts(tiny_model_dir: Path) -> None:
    """The replay (benchmarks/engine/spec_replay.py) runs the step's own proposal classes over a greedy
    output: for one request it must propose and accept exactly what the engine's step did."""
    import asyncio
    import random

    from benchmarks.engine.engine_loop import engine_config
    from benchmarks.engine.spec_replay import one_row_floor, replay
    from benchmarks.engine.speculative import _one
    from engine.loop import AsyncEngine

    rng = random.Random(3)
    phrase = [rng.randrange(5, 200) for _ in range(24)]
    prompt = phrase * 4 + phrase[:5]  # the model's greedy output tends to run on with what it has seen

    async def run(spec: object) -> tuple[list[int], dict]:
        engine = AsyncEngine(engine_config(str(tiny_model_dir), 8, None, True, {"speculative": spec}))
        await engine.wait_ready()
        try:
            out = await _one(engine, prompt, 80, "r")
            return out, (await engine.call(lambda e: e.status()))["runner"]
        finally:
            await engine.shutdown(drain_s=0)

    off, _ = asyncio.run(run("off"))
    on, counts = asyncio.run(run({"method": "prompt_lookup"}))
    assert on == off
    result = replay([{"prompt": prompt, "output": off}], {}, one_row_floor("cpu"))
    assert counts["spec_proposed_tokens"] > 0
    assert (result["proposed"], result["accepted"]) == (counts["spec_proposed_tokens"], counts["spec_accepted_tokens"])
    assert result["tokens"] == len(off) - 1 and result["steps"] == len(off) - 1 - result["accepted"]


def test_the_step_report_splits_a_levels_mean_ttft_by_the_servers_own_sums() -> None:
    """From two /metrics scrapes: the engine's mean TTFT and queue time (its sums over its first
    tokens) and the ingress's mean TTFT (its histogram, summed over labels), for the level between."""
    from benchmarks.harness.step_report import from_metrics, report

    def exposition(steps: int, firsts: int, ttft: float, queue: float, ingress: tuple[float, float]) -> str:
        return "\n".join([
            f"pomona_engine_steps {steps}", f"pomona_engine_first_tokens {firsts}",
            f"pomona_engine_ttft_seconds_sum {ttft}", f"pomona_engine_queue_seconds_sum {queue}",
            'pomona_engine_mlx_thread_seconds{kind="step"} 1.0',
            f'pomona_time_to_first_token_seconds_sum{{model="a"}} {ingress[0] / 2}',
            f'pomona_time_to_first_token_seconds_sum{{model="b"}} {ingress[0] / 2}',
            f'pomona_time_to_first_token_seconds_count{{model="a"}} {ingress[1]}',
            'pomona_time_to_first_token_seconds_bucket{model="a",le="0.1"} 3'])

    before = from_metrics(exposition(10, 4, 0.4, 0.1, (0.6, 4)))
    after = from_metrics(exposition(30, 14, 1.4, 0.3, (2.1, 14)))
    got = report(before, after, 2.0)
    assert (got["engine_ttft_ms"], got["engine_queue_ms"], got["ingress_ttft_ms"]) == (100.0, 20.0, 150.0)
    assert from_metrics("pomona_time_to_first_token_seconds_sum 1.0") is None  # no engine: not Pomona's


def test_step_build_times_each_kind_of_gpu_step_and_computes_nothing(tiny_model_dir: Path) -> None:
    """benchmarks/engine/step_build.py: the host time of building a GPU-shaped decode step and a
    mixed one (two forwards, one flat), with MLX's evaluation put back afterwards."""
    import mlx.core as mx

    from benchmarks.engine.step_build import run

    start_work = mx.async_eval
    result = run(str(tiny_model_dir), rows=2, chunk=20, rounds=3)
    assert set(result) == {"decode", "mixed-two", "mixed-flat", "verify"} and all(ms > 0 for ms in result.values())
    assert mx.async_eval is start_work
