"""Reading an SSD hit back or computing it again (engine/restore_choice.py): the rule alone, then the
engine with the real tiered store after a restart, the rates set as a slow or a fast disk would."""

from __future__ import annotations

import engine.restore_choice as restore_choice
from engine.restore_choice import MIN_SAMPLE_TOKENS, RestoreChoice, RestoreChoiceConfig
from engine.loop import default_store
from engine_helpers import collect, make_engine, request, run
from test_engine_cache import LONG, cache_config, cold_texts  # noqa: F401 - the fixture


def test_reads_while_a_rate_is_unknown_or_reading_is_not_clearly_slower() -> None:
    choice = RestoreChoice(RestoreChoiceConfig(margin=1.5, explore_every=8))
    assert choice.should_read()  # nothing measured
    choice.record_prefill(1000, 1.0)  # 1 ms a token
    assert choice.should_read()  # no read measured yet
    choice.record_read(1000, 1.4)  # 1.4 ms a token: within the margin
    assert choice.should_read()
    assert choice.declined == 0


def test_declines_a_slow_read_and_reads_again_every_nth_time() -> None:
    choice = RestoreChoice(RestoreChoiceConfig(margin=1.5, explore_every=4))
    choice.record_prefill(1000, 1.0)
    choice.record_read(1000, 3.0)
    answers = [choice.should_read() for _ in range(8)]
    assert answers == [False, False, False, True] * 2  # the 4th decline in a row reads: the disk measured again
    assert (choice.declined, choice.explored) == (6, 2)
    assert choice.as_dict()["read_ms_per_token"] == 3.0


def test_rates_are_averages_short_samples_are_not_rates_and_always_reads() -> None:
    choice = RestoreChoice(RestoreChoiceConfig(margin=1.5))
    choice.record_read(MIN_SAMPLE_TOKENS - 1, 100.0)  # too short to be a rate
    assert choice.read.s_per_token is None
    choice.record_read(1000, 4.0)
    choice.record_read(1000, 1.0)  # the disk got faster: the average moves toward it
    assert 1e-3 < choice.read.s_per_token < 4e-3 and choice.read.samples == 2
    choice.record_prefill(1000, 0.5)
    assert not choice.should_read()
    off = RestoreChoice(enabled=False)
    off.record_prefill(1000, 0.5)
    off.record_read(1000, 100.0)
    assert off.should_read() and off.declined == 0


def _restarted(tiny_model_dir, tmp_path, **cache_kw):
    config = cache_config(tmp_path, **cache_kw)
    eng = make_engine(tiny_model_dir, store_factory=default_store, cache=config)
    run(collect(eng, request(eng, LONG + "Who?", max_tokens=20)))
    run(eng.shutdown())  # flushes the SSD writes
    return make_engine(tiny_model_dir, store_factory=default_store, cache=config)


def _set_rates(eng, read_s: float, prefill_s: float) -> None:
    async def go():
        await eng.call(lambda e: (e.restores.record_prefill(1000, prefill_s), e.restores.record_read(1000, read_s)))
    run(go())


def test_a_disk_measured_slower_than_prefill_is_not_read(tiny_model_dir, tmp_path, cold_texts):  # noqa: F811
    eng = _restarted(tiny_model_dir, tmp_path)
    try:
        _set_rates(eng, read_s=10.0, prefill_s=1.0)  # reading 10x slower than computing
        text, events = run(collect(eng, request(eng, LONG + "Where?", max_tokens=20)))
        assert text == cold_texts["Where?"]
        assert events[-1].usage.cached_tokens == 0  # computed again: RAM was empty after the restart
        stats = eng.stats()
        assert stats["ssd_reads"]["declined"] == 1
        assert stats["cache"]["ssd"]["hits"] == 0
    finally:
        run(eng.shutdown())


def test_a_disk_measured_fast_is_read_and_the_read_is_measured(tiny_model_dir, tmp_path, cold_texts,  # noqa: F811
                                                             monkeypatch):
    monkeypatch.setattr(restore_choice, "MIN_SAMPLE_TOKENS", 1)  # the tiny prompt's read counts as a rate
    eng = _restarted(tiny_model_dir, tmp_path)
    try:
        _set_rates(eng, read_s=0.001, prefill_s=1.0)  # (the first run's prefill, kept, is in the average)
        text, events = run(collect(eng, request(eng, LONG + "Where?", max_tokens=20)))
        assert text == cold_texts["Where?"]
        assert events[-1].usage.cache_tier == "ssd" and events[-1].usage.cached_tokens >= 16
        reads = eng.stats()["ssd_reads"]
        assert reads["declined"] == 0 and reads["reads_measured"] == 2  # the one set here, then the real read
        assert reads["prefills_measured"] == 2  # and the prefill of the prompt's rest past the hit
    finally:
        run(eng.shutdown())


def test_always_reads_whatever_was_measured(tiny_model_dir, tmp_path, cold_texts):  # noqa: F811
    eng = _restarted(tiny_model_dir, tmp_path, ssd_reads="always")
    try:
        _set_rates(eng, read_s=10.0, prefill_s=1.0)
        events = run(collect(eng, request(eng, LONG + "Where?", max_tokens=20)))[1]
        assert events[-1].usage.cache_tier == "ssd"
        assert eng.stats()["ssd_reads"]["declined"] == 0
    finally:
        run(eng.shutdown())


def test_ssd_reads_setting_is_checked() -> None:
    import pytest

    from cache_tiers.config import CacheConfig

    with pytest.raises(ValueError, match="ssd_reads"):
        CacheConfig(ssd_reads="never")


def test_the_rates_outlive_a_restart_so_its_first_ssd_hit_is_chosen_too(tiny_model_dir, tmp_path,  # noqa: F811
                                                                         cold_texts):
    """The SSD's hits come right after a restart: the rates the last run measured are kept beside the
    SSD's files, so a disk known to be slow is not read even once more."""
    config = cache_config(tmp_path)
    eng = make_engine(tiny_model_dir, store_factory=default_store, cache=config)
    run(collect(eng, request(eng, LONG + "Who?", max_tokens=20)))
    _set_rates(eng, read_s=10.0, prefill_s=1.0)
    run(eng.shutdown())
    assert list((tmp_path / "ssd").glob("read-rates-*.json"))
    eng = make_engine(tiny_model_dir, store_factory=default_store, cache=config)
    try:
        text, events = run(collect(eng, request(eng, LONG + "Where?", max_tokens=20)))
        assert text == cold_texts["Where?"]
        assert events[-1].usage.cached_tokens == 0
        reads = eng.stats()["ssd_reads"]
        assert reads["declined"] == 1 and reads["read_ms_per_token"] == 10.0
    finally:
        run(eng.shutdown())


def test_saved_rates_round_trip_and_a_damaged_file_is_ignored(tmp_path) -> None:
    from engine.restore_choice import rates_file

    path = rates_file(str(tmp_path), "tiny:/some/dir@abc")
    assert path is not None and path.parent == tmp_path and rates_file(None, "abc123") is None
    choice = RestoreChoice()
    choice.record_read(1000, 2.0)
    choice.save(path)
    again = RestoreChoice()
    again.load(path)
    assert again.read.s_per_token == 2e-3 and again.prefill.s_per_token is None
    path.write_text("{not json")
    fresh = RestoreChoice()
    fresh.load(path)
    assert fresh.read.s_per_token is None
    fresh.load(tmp_path / "missing.json")
    assert fresh.read.s_per_token is None
