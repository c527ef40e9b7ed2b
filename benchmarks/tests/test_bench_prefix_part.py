"""benchmarks/engine/prefix_part.py: a request's TTFT split by the engine's step log (no model)."""

from __future__ import annotations

import pytest

from benchmarks.engine.prefix_part import _parse_variant, timeline


def test_a_warm_requests_ttft_is_split_at_its_admitting_step():
    # steps: (start, end, running rows, admitted ids); the request is sent at 1.0 during step 0
    steps = [(0.990, 1.010, 3, ()), (1.010, 1.040, 3, ("r",)), (1.040, 1.050, 4, ()), (1.050, 1.060, 4, ())]
    runs = [0.008, 0.020, 0.009, 0.009]
    req = {"id": "r", "sent": 1.000, "first": 1.052, "cached": 2000, "prompt": 2070}
    t = timeline(req, steps, runs)
    assert t["ttft_ms"] == pytest.approx(52.0)
    assert t["to_admit_ms"] == pytest.approx(10.0)  # the step running when it arrived
    assert t["admit_step_ms"] == pytest.approx(30.0) and t["admit_run_ms"] == pytest.approx(20.0)
    assert t["after_ms"] == pytest.approx(12.0) and t["steps_after"] == 2.0
    assert t["steps_waited"] == 1.0 and t["rows_at_admit"] == 3.0


def test_a_request_never_admitted_keeps_only_its_ttft():
    assert timeline({"id": "x", "sent": 0.0, "first": 0.5}, [(0.0, 0.1, 1, ("y",))]) == {"ttft_ms": 500.0}


def test_variants_override_engine_and_cache_settings():
    from benchmarks.engine.engine_loop import engine_config

    name, overrides = _parse_variant("nossd:cache.ssd_dir=null,prefill_chunk=512")
    assert name == "nossd" and overrides == {"cache.ssd_dir": None, "prefill_chunk": 512}
    config = engine_config("model", None, "/tmp/fresh-ssd", overrides=overrides)
    assert config.cache.ssd_dir is None and config.cache.block_size == 64 and config.prefill_chunk == 512  # the rest as configured
    assert engine_config("model", None, "/tmp/fresh-ssd", overrides=_parse_variant("d:")[1]).cache.ssd_dir == "/tmp/fresh-ssd"
    assert _parse_variant("default:") == ("default", {})
