"""api/service/model_status.py without Ray: a replica's phases as posted to the board, and their summary."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from api.service.model_status import ModelStatus, StatusBoard, describe


def _status() -> tuple[ModelStatus, list[dict[str, Any]]]:
    posted: list[dict[str, Any]] = []
    return ModelStatus("m", "org/m", lambda key, entry: posted.append({"key": key, **entry})), posted


def test_progress_is_posted_and_summarised() -> None:
    status, posted = _status()
    status.progress(1_500_000, 6_000_000)
    status.post()
    assert posted[-1]["phase"] == "downloading" and posted[-1]["bytes_done"] == 1_500_000
    assert describe([posted[-1]]) == "m: downloading 1.5/6.0 MB (25%)"
    status.set(phase="ready")
    assert posted[-1]["phase"] == "ready" and describe([posted[-1]]) == "m: ready"


def test_a_local_model_needs_no_download(tiny_model_dir: Path) -> None:
    status, posted = _status()

    async def run() -> None:
        await status.prepare(str(tiny_model_dir))
        status.stop()
    asyncio.run(run())
    assert status.entry()["phase"] == "loading" and status.entry()["bytes_done"] == 0


def test_a_refused_model_is_posted_as_failed_with_the_advice() -> None:
    status, posted = _status()

    async def run() -> None:
        try:
            await status.prepare("bad id!")
        finally:
            status.stop()
    with pytest.raises(ValueError):
        asyncio.run(run())
    assert posted[-1]["phase"] == "failed" and "valid Hugging Face repo id" in posted[-1]["error"]
    assert describe([posted[-1]]).startswith("m: failed: model 'bad id!'")


def test_the_board_keeps_one_entry_per_replica() -> None:
    board = StatusBoard()
    board.report("m|h|1", {"model": "m", "host": "h", "pid": 1, "phase": "loading"})
    board.report("m|h|1", {"model": "m", "host": "h", "pid": 1, "phase": "ready"})
    board.report("n|h|2", {"model": "n", "host": "h", "pid": 2, "phase": "downloading"})
    assert [(e["model"], e["phase"]) for e in board.read()] == [("m", "ready"), ("n", "downloading")]
