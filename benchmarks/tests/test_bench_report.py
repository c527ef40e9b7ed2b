"""Benchmark bookkeeping without servers: goal ratios, the docs page, plots, the float32 model copy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.harness import docs
from benchmarks.harness.goals import all_goals
from benchmarks.harness.report import plot_sweep


def _agg(tok_s: float, ttft_ms: float, by_turn: dict[str, float] | None = None) -> dict:
    summary = {"mean": ttft_ms, "p50": ttft_ms, "p95": ttft_ms, "p99": ttft_ms}
    return {"completed": 4, "errors": 0, "request_throughput": 1.0, "output_throughput": tok_s,
            "ttft_ms": summary, "tpot_ms": summary, "itl_ms": summary, "e2e_ms": summary,
            "cached_token_share": 0.5, "concurrency": 8, "ttft_p50_ms_by_turn": by_turn or {"0": ttft_ms}}


def _server(tok_s: float, ttft: float) -> dict:
    return {"sweep": {"8": _agg(tok_s, ttft), "16": _agg(tok_s, ttft), "32": _agg(tok_s * 2, ttft)},
            "prefix": _agg(tok_s, ttft), "multiturn": _agg(tok_s, ttft, {"0": 100.0, "7": 110.0})}


def test_goals_are_ratios_of_the_same_run(tmp_path: Path) -> None:
    results = {"pomona": _server(200.0, 50.0), "vllm-mlx": _server(100.0, 200.0),
               "mlx_lm.server": {"skipped": "not installed"}}
    bare = {"16": {"requests": 32, "output_throughput": 210.0, "ttft_ms_p50": 10.0}}
    goals = {g.name: g for g in all_goals(results, bare)}
    assert goals["output tok/s at concurrency 8: Pomona / vllm-mlx"].ratio == pytest.approx(2.0)
    assert goals["output tok/s at concurrency 8: Pomona / mlx_lm.server"].ratio is None
    assert goals["TTFT p50, prefix repetition: Pomona / vllm-mlx"].met is True
    overhead = goals["serving overhead: Pomona HTTP / bare BatchGenerator loop, concurrency 16"]
    assert overhead.ratio == pytest.approx(200 / 210)
    assert goals["multi-turn TTFT p50, turn 8 / turn 1 (pomona)"].ratio == pytest.approx(1.1)

    plots = plot_sweep({k: v for k, v in results.items() if "sweep" in v}, tmp_path / "plots")
    page = docs.write(tmp_path / "docs" / "benchmarks.md", results=results, bare=bare,
                      goals=list(goals.values()), plots=plots, commands=["python -m benchmarks.harness.side_by_side"],
                      model_dir=tmp_path, suite={"quick": True}, notes=["mlx_lm.server: not installed"])
    text = page.read_text()
    assert "| output tok/s at concurrency 8: Pomona / vllm-mlx | 2.00 | >= 1.3 | yes |" in text
    assert all((tmp_path / "docs" / "img" / p.name).exists() for p in plots)


def test_float32_copy_dequantizes(tiny_model_dir: Path, tmp_path: Path) -> None:
    import mlx.core as mx
    from mlx_lm import convert
    from mlx_lm.utils import load_model

    from benchmarks.harness.models import float32_copy

    quant = tmp_path / "q"
    convert(str(tiny_model_dir), mlx_path=str(quant), quantize=True, q_group_size=32, q_bits=8)
    dst = float32_copy(quant, tmp_path / "f32")
    config = json.loads((dst / "config.json").read_text())
    assert "quantization" not in config and "quantization_config" not in config
    model, _ = load_model(dst)
    from mlx.utils import tree_flatten

    assert all(v.dtype == mx.float32 for _, v in tree_flatten(model.parameters()))
    assert (dst / "tokenizer.json").exists()
    assert float32_copy(quant, dst) == dst  # second call reuses the copy
