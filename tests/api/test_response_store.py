"""The /v1/responses store: a real diskcache directory (round trip, expiry, the byte bound, no pickle)."""

from __future__ import annotations

import time

import diskcache
import pytest

from api.core.conversation import Message, ToolCall
from api.responses.store import ResponseStore, ResponseStoreSettings, StoredResponse


def rid(i: int) -> str:
    return f"resp_{i:032x}"


def stored(text: str = "hi") -> StoredResponse:
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    return StoredResponse({"id": "x", "output": [{"type": "message"}]},
                          (Message("user", text), Message("assistant", "", (call,), reasoning="r"),
                           Message("tool", "18C", tool_call_id="call_1", name="get_weather")))


def test_store_round_trip_unknown_and_delete(tmp_path):
    store = ResponseStore(ResponseStoreSettings(), str(tmp_path / "r"))
    store.put(rid(1), stored())
    assert store.get(rid(1)) == stored()
    assert store.get(rid(2)) is None and store.get("../etc") is None
    assert store.delete(rid(1)) and store.get(rid(1)) is None and not store.delete(rid(1))
    store.close()


def test_store_expires_entries(tmp_path):
    store = ResponseStore(ResponseStoreSettings(max_age_s=0.5), str(tmp_path / "r"))
    store.put(rid(1), stored())
    assert store.get(rid(1)) is not None
    time.sleep(0.8)
    assert store.get(rid(1)) is None


def test_store_is_bounded_in_bytes(tmp_path):
    limit = 2**20
    store = ResponseStore(ResponseStoreSettings(size_bytes=limit), str(tmp_path / "r"))
    for i in range(80):  # 80 x ~40 KB = ~3 MB into a 1 MiB store
        store.put(rid(i), stored("x" * 40_000))
    assert store.volume() <= limit + 100_000
    assert store.get(rid(0)) is None and store.get(rid(79)) is not None


def test_store_never_unpickles(tmp_path):
    directory = str(tmp_path / "r")
    with diskcache.Cache(directory) as plain:
        plain.set(rid(1), {"pickled": True})  # a pickled row, as a plain diskcache writes
    store = ResponseStore(ResponseStoreSettings(), directory)
    assert store.get(rid(1)) is None


def test_default_directory_is_beside_the_ssd_tier():
    s = ResponseStoreSettings()
    assert s.resolved_directory("/data/pomona/kv") == "/data/pomona/kv-responses"
    assert s.resolved_directory(None).endswith("/.cache/pomona/responses")
    assert ResponseStoreSettings(directory="/x").resolved_directory("/data/kv") == "/x"
    with pytest.raises(ValueError):
        ResponseStoreSettings.from_dict({"size": 1})
