"""Two tiny models in one app over real Ray Serve: each request is answered by the model it names,
/v1/models lists both, an unknown model is 404 model_not_found, and prefix-cache hits never cross
models even with one shared SSD directory (entries are keyed by each model's fingerprint)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from e2e_helpers import serve_apps, tiny_args, wait_healthy

PROMPT = "the quick brown fox jumps over the lazy dog " * 8  # long enough to be cached (> block size)
NAMES = ("tiny-a", "tiny-b")


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tiny_model import build_tiny_model

    return {"tiny-a": tiny_model_dir, "tiny-b": build_tiny_model(tmp_path_factory.mktemp("tiny-b"), seed=7)}


def _greedy(model_dir: Path, text: str, max_tokens: int) -> str:
    """What the model itself says, in process, through the same loader the replicas use."""
    from cache_tiers.config import CacheConfig
    from engine.config import EngineConfig
    from engine.loop import AsyncEngine
    from engine.types import Request, SamplingParams

    async def run() -> str:
        engine = AsyncEngine(EngineConfig(model=str(model_dir), cache=CacheConfig(enabled=False)))
        await engine.wait_ready(120)
        try:
            request = Request(tuple(engine.tokenizer.encode(text)), SamplingParams(temperature=0.0, max_tokens=max_tokens))
            return "".join([e.text async for e in engine.generate(request)])
        finally:
            await engine.shutdown()
    return asyncio.run(run())


@pytest.fixture(scope="module")
def base(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args: dict[str, Any] = tiny_args(model_dirs["tiny-a"])
    del args["model"], args["served_model_name"]
    args["engine"]["cache"]["ssd_dir"] = str(tmp_path_factory.mktemp("shared-ssd"))  # one dir, both models
    args["models"] = [{"model": str(path), "served_model_name": name} for name, path in model_dirs.items()]
    with serve_apps({"/": args}) as url:
        wait_healthy(url)
        yield url


def _complete(base: str, model: str, prompt: str, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=120,
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def _channel_items(base: str, model: str) -> float:
    text = httpx.get(f"{base}/metrics", params={"model": model}, timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith('pomona_engine_stream_items{kind="channel"}'))
    return float(line.rsplit(" ", 1)[1])


def test_each_model_answers_its_own_requests(base: str, model_dirs: dict[str, Path]) -> None:
    listed = httpx.get(f"{base}/v1/models", timeout=10).json()
    assert sorted(m["id"] for m in listed["data"]) == sorted(NAMES)
    health = httpx.get(f"{base}/health", timeout=10).json()
    assert health["status"] == "ok" and sorted(m["model"] for m in health["models"]) == sorted(NAMES)
    answers = {}
    for name in NAMES:
        r = _complete(base, name, "hello there", 12)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name
        answers[name] = r.json()["choices"][0]["text"]
    assert answers["tiny-a"] != answers["tiny-b"]  # two different models, really both served
    for name in NAMES:
        assert answers[name] == _greedy(model_dirs[name], "hello there", 12)  # and each by the right one
    for name in NAMES:  # each model's tokens after the first batch came on its step channel
        assert _channel_items(base, name) > 0, name
    chat = httpx.post(f"{base}/v1/chat/completions", timeout=120,
                      json={"model": "tiny-b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["model"] == "tiny-b", chat.text


def test_unknown_model_is_404_model_not_found(base: str) -> None:
    r = _complete(base, "tiny-c", "hello")
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found"


def test_prefix_hits_never_cross_models(base: str) -> None:
    def cached(model: str) -> int:
        r = _complete(base, model, PROMPT, 2)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached("tiny-a")
    assert cached("tiny-a") > 0  # the cache works at all
    flushed = httpx.post(f"{base}/admin/cache/flush", timeout=60)  # tiny-a's entries are on the shared SSD now
    assert flushed.status_code == 200, flushed.text
    assert cached("tiny-b") == 0  # same tokens, same SSD directory, other model: no hit
    assert cached("tiny-b") > 0
