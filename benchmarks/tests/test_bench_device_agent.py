"""The device harness's agent workload without servers or a GPU (issue 31): the device model's context
fits the agent trace, the SSD-growth maths (KV bytes per token, admin answers, a conversation against a
fake server), the chunk-gap windows, and the goals read from the parts' results."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.device import device_goals
from benchmarks.engine import ssd_growth
from benchmarks.harness.client import EndpointConfig
from benchmarks.harness.workloads import TextMaker

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}


def test_kv_bytes_per_token_from_the_config() -> None:
    assert ssd_growth.kv_bytes_per_token(SMOLLM2, 2) == 30 * 3 * 64 * 2 * 2  # head_dim = 576 / 9
    assert ssd_growth.kv_bytes_per_token({**SMOLLM2, "head_dim": 128}, 4) == 30 * 3 * 128 * 2 * 4
    mha = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}  # no kv heads: MHA
    assert ssd_growth.kv_bytes_per_token({"text_config": mha}, 2) == 2 * 4 * 64 * 2 * 2
    assert ssd_growth.kv_dtype({"torch_dtype": "bfloat16"}, "float16") == "float16"


def test_ssd_stats_reads_the_first_replica() -> None:
    answer = {"object": "list", "data": [{"replica": {"pid": 1}, "cache": {"ssd": {"bytes": 5, "queued": 0}}}]}
    assert ssd_growth.ssd_stats(answer) == {"bytes": 5, "queued": 0}
    assert ssd_growth.ssd_stats({"data": []}) == {}
    assert ssd_growth.ssd_stats({"data": [{"cache": {"ssd": {"enabled": False}}}]}) == {"enabled": False}


def test_gap_windows() -> None:
    s1 = ssd_growth.Stream(stamps=[0.0, 0.1, 0.2, 0.3, 1.3, 1.4, 2.4, 2.5])
    s2 = ssd_growth.Stream(stamps=[0.05, 0.15, 0.25])
    marks = {"baseline": 0.0, "long_sent": 1.0, "long_done": 2.0, "flushed": 3.0}
    g = ssd_growth.gap_summary([s1, s2], marks)
    assert g["baseline"]["chunks"] == 5 and g["baseline"]["p50_ms"] == pytest.approx(100)
    assert g["prefill"]["chunks"] == 2 and g["prefill"]["max_ms"] == pytest.approx(1000)
    assert g["persist"]["chunks"] == 2 and g["persist"]["max_over_baseline_p50"] == pytest.approx(10)
    assert g["all"]["chunks"] == 9
    empty = ssd_growth.gap_summary([ssd_growth.Stream()], marks)
    assert empty["persist"] == {"chunks": 0, "seconds": 1.0}


def _fake_pomona(entry_bytes_per_token: int) -> tuple[httpx.MockTransport, dict[str, Any]]:
    """Chat completions that echo their size; an SSD tier that stores every finished turn whole."""
    state: dict[str, Any] = {"ssd": 1000, "requests": []}  # 1,000 bytes before turn 1 (the readiness probe)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            body = json.loads(request.content)
            state["requests"].append(body)
            prompt = sum(len(m["content"].split()) for m in body["messages"])
            state["ssd"] += (prompt + body["max_tokens"]) * entry_bytes_per_token
            chunks = [{"choices": [{"delta": {"content": "word "}}]} for _ in range(body["max_tokens"])]
            chunks.append({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": body["max_tokens"]}})
            text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
        if request.url.path in ("/admin/cache", "/admin/cache/flush"):
            return httpx.Response(200, json={"object": "list", "data": [
                {"replica": {"pid": 1}, "cache": {"ssd": {"bytes": state["ssd"], "keys": 1, "queued": 0}}}]})
        return httpx.Response(404)
    return httpx.MockTransport(handler), state


def test_growth_against_a_whole_entry_store() -> None:
    """A store that writes each turn's whole conversation: the ratio grows with the turns."""
    transport, state = _fake_pomona(10)
    cfg = EndpointConfig("http://pomona.test/v1", "m", {"ignore_eos": True})
    maker = TextMaker(None)  # a word is a token
    g = asyncio.run(ssd_growth.growth(cfg, maker, 10, turns=3, first=100, grow=50, max_tokens=5,
                                      fixed_replies=False, transport=transport))
    tokens = [r["conversation_tokens"] for r in g["turns"]]
    assert tokens == [100, 150, 200]
    assert g["final_conversation_tokens"] == 200 and g["kv_bytes_per_token"] == 10
    assert g["final_ssd_bytes"] == (100 + 150 + 200) * 10  # the probe's 1,000 bytes left out
    assert g["final_ratio"] == pytest.approx(450 / 200)
    ratios = [r["ratio"] for r in g["turns"]]
    assert ratios == sorted(ratios) and ratios[0] == pytest.approx(1.0)
    last = state["requests"][-1]
    assert last["temperature"] == 0.0 and last["ignore_eos"] is True and last["max_tokens"] == 5
    assert [m["role"] for m in last["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    assert last["messages"][1]["content"] == "word " * 5  # the server's own reply is sent back


def _turns(ttfts_ms: list[float], e2e_s: float) -> list[dict[str, Any]]:
    return [{"turn": k, "ok": True, "ttft_s": t / 1000, "e2e_s": e2e_s} for k, t in enumerate(ttfts_ms, start=1)]


def test_agent_goals() -> None:
    data = {"expected_prompt_tokens": [1, 2, 3, 4],
            "servers": {"pomona": {"session_s": 3.0, "turns": _turns([600, 100, 200, 400], 0.75)},
                        "mlx_lm.server": {"session_s": 6.0, "turns": _turns([2000, 400, 400, 400], 1.5)}}}
    goals = {g.name: g for g in device_goals.agent_goals(data)}
    assert goals["agent session time: Pomona / mlx_lm.server"].ratio == pytest.approx(0.5)
    assert goals["agent TTFT turn 1 (cold): Pomona / mlx_lm.server"].ratio == pytest.approx(0.3)
    median = goals["agent TTFT turns 2-4: median of Pomona / mlx_lm.server"]
    worst = goals["agent TTFT turns 2-4: max of Pomona / mlx_lm.server"]
    assert median.ratio == pytest.approx(0.5) and median.met is True
    assert worst.ratio == pytest.approx(1.0) and worst.met is False and "turn 4" in worst.detail
    data["servers"]["pomona"]["turns"][2]["ok"] = False  # an incomplete session compares nothing
    goals = {g.name: g for g in device_goals.agent_goals(data)}
    assert goals["agent session time: Pomona / mlx_lm.server"].ratio is None
    assert goals["agent TTFT turns 2-4: median of Pomona / mlx_lm.server"].ratio is None
    assert all(g.ratio is None for g in device_goals.agent_goals(None))


def test_reuse_and_ssd_goals_and_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def part(p50: float, by_turn: dict[str, float]) -> dict[str, Any]:
        return {"ttft_ms": {"p50": p50}, "ttft_p50_ms_by_turn": by_turn}
    reuse = {"servers": {"pomona": {"prefix": part(50, {}), "multiturn": part(70, {"0": 100, "7": 110})},
                         "mlx_lm.server": {"prefix": part(200, {}), "multiturn": part(100, {"0": 90, "7": 95})}}}
    goals = {g.name: g for g in device_goals.reuse_goals(reuse)}
    assert goals["multi-turn TTFT p50: Pomona / mlx_lm.server"].ratio == pytest.approx(0.7)
    assert goals["multi-turn TTFT p50, Pomona turn 8 / turn 1"].ratio == pytest.approx(1.1)
    assert goals["prefix TTFT p50: Pomona / mlx_lm.server"].ratio == pytest.approx(0.25)
    ssd = {"kv_dtype": "bfloat16", "growth": {"final_ratio": 1.2, "final_conversation_tokens": 2000,
                                              "final_ssd_bytes": 2400 * 23040, "kv_bytes_per_token": 23040},
           "gaps": {"streams": 4, "long_prompt_tokens": 15000, "persist_window_s": 5.2, "flush_s": 0.2,
                    "windows": {"baseline": {"p50_ms": 10.0}, "persist": {"p99_ms": 30.0, "max_ms": 50.0}}}}
    goals = {g.name: g for g in device_goals.ssd_goals(ssd)}
    assert goals["SSD bytes / final KV size of a growing conversation"].met is True
    gap = goals["chunk gap max while a long turn is persisted / baseline p50 (reference)"]
    assert gap.ratio == pytest.approx(5.0) and gap.met is None
    assert len(device_goals.all_goals(None, reuse, None, only_given=True)) == 3
    assert len(device_goals.all_goals(None, reuse, None)) == 10
    (tmp_path / "reuse-smollm2.json").write_text(json.dumps(reuse))
    (tmp_path / "ssd-smollm2.json").write_text(json.dumps(ssd))
    assert device_goals.main(["--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| prefix TTFT p50: Pomona / mlx_lm.server | 0.25 | <= 0.5 | yes |" in out
    assert "| agent session time: Pomona / mlx_lm.server | n/a | <= 0.6 | — |" in out


def test_device_model_context_fits_the_agent_trace(tmp_path: Path) -> None:
    """The smollm2 shape's tokenizer (random BPE: ~21k tokens for the trace) and CONTEXT leave room for the
    trace's last turn and its answer; smollm2-mini has the same tokenizer."""
    from benchmarks.agent.agent_session import expected_prompt_tokens, token_counter
    from benchmarks.agent.agent_trace import build_trace
    from benchmarks.device.device_models import CONTEXT
    from benchmarks.device.device_serve_model import SHAPES, build

    assert SHAPES["smollm2-mini"]["vocab_size"] == SHAPES["smollm2"]["vocab_size"]
    model = build("smollm2-mini", tmp_path / "m", "float32")
    config = json.loads((model / "config.json").read_text())
    assert config["max_position_embeddings"] == CONTEXT == 32768
    tok, count = token_counter(model)
    prompts = expected_prompt_tokens(tok, build_trace(count))
    assert prompts[-1] > 4096 and prompts[-1] + 32 <= CONTEXT


def test_host_reads_probe_measures_each_part_both_ways() -> None:
    """benchmarks/device/host_reads.py (the SSD tier's cost on CUDA): each part times the same work on
    untouched and host-read blocks and reports their ratio; the CPU, with nothing to migrate, is its
    dry run."""
    from benchmarks.device import host_reads

    out = host_reads.run(blocks=2, block_mb=0.05, rounds=2, iters=3)
    for part in ("gather", "recycled", "overlap"):
        row = out[part]
        assert row["untouched_ms"] > 0 and row["host_read_ms"] > 0
        assert row["ratio"] == pytest.approx(row["host_read_ms"] / row["untouched_ms"], rel=0.01)
