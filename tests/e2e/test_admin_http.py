"""Per-request status and cache administration over real HTTP on a real local Ray Serve (tiny model).

One app behind an API key, with an SSD tier, one running slot and small prefill chunks, so a request
can be watched going through queued -> prefill (with progress) -> decode.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from e2e_helpers import tiny_args, wait_healthy
from reliability_helpers import admin, auth, cache_stats, live_requests, own_cluster, token_prompt, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
KEY = "sk-admin-test-0123"


@pytest.fixture(scope="module")
def base(tiny_model_dir, tmp_path_factory):
    ssd = tmp_path_factory.mktemp("admin-ssd") / "prefix"
    args = tiny_args(tiny_model_dir, api_keys=[KEY], admin_api_keys=[KEY],  # one key, both scopes
                     engine={"max_running": 1, "prefill_batch": 1, "prefill_chunk": 8, "max_batch_tokens": 8,
                             "cache": {"enabled": True, "ram_bytes": 64 * 2**20, "min_restore_tokens": 16,
                                       "ssd_dir": str(ssd), "block_size": 16}})
    with own_cluster({"/": args}, apple_silicon=1) as url:
        wait_healthy(url)
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)


def complete(client, prompt, max_tokens=2, **kw):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}, **kw)


async def watch(base: str, long_prompt: list[int], short_prompt: list[int]) -> dict[str, list[dict]]:
    """Run a long request and a short one behind it; record every status entry seen, by phase."""
    seen: dict[str, list[dict]] = {}
    body = {"model": "tiny", "prompt": long_prompt, "max_tokens": 300, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=base, headers=auth(KEY), timeout=120) as http:
        long = asyncio.create_task(http.post("/v1/completions", json=body))
        await asyncio.sleep(0.05)
        short = asyncio.create_task(http.post("/v1/completions", json={**body, "prompt": short_prompt,
                                                                       "max_tokens": 2, "stream": False}))
        for _ in range(3000):
            replicas = (await http.get("/admin/requests")).json()["data"]
            for entry in replicas[0]["requests"]:
                seen.setdefault(entry["phase"], []).append(entry)
            if "decode" in seen and any(e["output_tokens"] >= 3 for e in seen["decode"]):
                break
            assert not long.done(), long.result().text
            await asyncio.sleep(0.01)
        long.cancel()  # leave: the long request is aborted, the short one then runs
        assert (await short).status_code == 200
    return seen


def test_status_shows_queued_prefill_and_decode(base):
    wait_idle(base, KEY)
    seen = asyncio.run(watch(base, token_prompt(1200, salt=1), token_prompt(20, salt=2)))
    assert {"queued", "prefill", "decode"} <= set(seen), sorted(seen)
    prefill = seen["prefill"][-1]
    done, total = prefill["prefill_progress"]
    assert total == 1200 and 0 <= done < total and prefill["prompt_tokens"] == 1200
    assert all(e["prompt_tokens"] == 20 for e in seen["queued"])
    decode = seen["decode"][-1]
    assert decode["output_tokens"] >= 3 and decode["ttft_s"] > 0 and decode["tokens_per_s"] > 0
    assert {"id", "age_s", "cached_tokens", "cache_tier"} <= set(decode)
    wait_idle(base, KEY)


def test_status_names_the_cache_tier_that_served_the_prefix(base, client):
    prompt = token_prompt(400, salt=3)
    complete(client, prompt)  # stores the prefix
    seen = asyncio.run(watch(base, prompt + [30, 31], token_prompt(20, salt=4)))
    decode = seen["decode"][-1]
    assert decode["cache_tier"] == "ram" and decode["cached_tokens"] >= 384
    wait_idle(base, KEY)


def test_admin_routes_need_the_key(base):
    for method, path in [("GET", "requests"), ("GET", "cache"), ("POST", "cache/clear"), ("POST", "reset"),
                         ("POST", "cache/flush")]:
        for headers in ({}, auth("wrong-key")):
            r = httpx.request(method, f"{base}/admin/{path}", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path


def test_cache_stats_flush_and_clear_each_tier(base, client):
    prompt = token_prompt(300, salt=5)
    first = complete(client, prompt)
    flushed = admin(base, "cache/flush", KEY, method="POST")
    assert flushed["replicas_reached"] == flushed["replicas_expected"] == 1
    stats = flushed["data"][0]["cache"]
    assert stats["ram"]["entries"] >= 1 and stats["ssd"]["writes"] >= 1 and stats["ssd"]["keys"] > 0
    assert stats["ssd"]["unwritten"] == 0  # a flush leaves nothing in RAM alone
    assert complete(client, prompt).usage.prompt_tokens_details.cached_tokens > 0

    after_ram = admin(base, "cache/clear", KEY, method="POST", tier="ram")["data"][0]["cache"]
    assert after_ram["ram"]["entries"] == 0 and after_ram["ssd"]["keys"] > 0
    hits_before = cache_stats(base, KEY)["ssd"]["hits"]
    assert complete(client, prompt).usage.prompt_tokens_details.cached_tokens > 0  # served by the SSD
    assert cache_stats(base, KEY)["ssd"]["hits"] == hits_before + 1

    after_ssd = admin(base, "cache/clear", KEY, method="POST", tier="ssd")["data"][0]["cache"]
    assert after_ssd["ssd"]["keys"] == 0 and after_ssd["ram"]["entries"] >= 1
    after_all = admin(base, "cache/clear", KEY, method="POST")["data"][0]["cache"]
    assert after_all["ram"]["entries"] == 0 and after_all["ssd"]["keys"] == 0
    again = complete(client, prompt)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].text == first.choices[0].text  # clearing changes speed, never answers


def test_clear_refuses_an_unknown_tier(base):
    r = httpx.post(f"{base}/admin/cache/clear", params={"tier": "gpu"}, headers=auth(KEY))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tier"


async def reset_during(base: str) -> tuple[list[str], dict]:
    body = {"model": "tiny", "prompt": token_prompt(30, salt=6), "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(base_url=base, headers=auth(KEY), timeout=120) as http:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = []
            reset: dict = {}
            async for line in resp.aiter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3 and not reset:
                    reset = (await http.post("/admin/reset")).json()
    return lines, reset


def test_deep_reset_ends_running_requests_with_an_error_and_keeps_serving(base, client):
    complete(client, token_prompt(300, salt=7))
    lines, reset = asyncio.run(reset_during(base))
    assert reset["data"][0]["failed_requests"] == 1, reset["data"]
    assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2] and "service_unavailable" in lines[-2]
    stats = cache_stats(base, KEY)
    assert stats["ram"]["entries"] == 0 and stats["ssd"]["keys"] == 0
    assert live_requests(base, KEY) == []
    assert complete(client, "after the reset", max_tokens=3).usage.completion_tokens == 3
