"""Stored responses for `store` / `previous_response_id` on /v1/responses: a bounded diskcache.

What is kept per response id: the response object as it was returned, the conversation so far
(the predecessors' messages, this turn's input messages and this turn's output as an assistant
message; never the `instructions`, which OpenAI does not carry over), and the input items in
OpenAI's item shapes for `GET /v1/responses/{id}/input_items` (the predecessors' input and output
items, then this turn's input, as OpenAI lists a chained response's context). A follow-up naming
`previous_response_id` starts from those messages, so its prompt begins with the earlier prompt
plus the earlier answer and the engine's prefix cache serves that part.

Settings (serve_config.yaml, `args: responses:`):
- `directory`: where the store lives. None (the default): beside the SSD tier's directory
  (`<engine.cache.ssd_dir>-responses`) when that tier is configured, else `~/.cache/pomona/responses`.
- `size_bytes` (default 1 GiB): diskcache's `size_limit`; past it the oldest-stored entries are evicted.
- `max_age_s` (default 30 days, OpenAI's retention): each entry expires that long after it was stored.
- `enabled` (default true): false stores nothing (responses say `"store": false`) and refuses
  `previous_response_id` with a 400 that says so.

Ownership: each entry records the tenant that stored it (api/service/auth.py; "" where no keys are set), and
`get` / `delete` answer only that tenant: to any other, a response is as absent as an unknown id
(the route's 404), so ids (which /admin/requests lists to admins) reveal nothing across tenants.

Who reads and writes: only the ingress replicas (the LLM server never sees the store). Several
ingress replicas on one host share the directory (diskcache is safe across processes); ingress
replicas on different hosts each have their own directory, so a follow-up routed to another host
than its predecessor's gets a 404: run one ingress host, or put `directory` on shared storage.

Values are JSON text stored as raw bytes through `RawBytesDisk`, which refuses to pickle or
unpickle anything. Every call here blocks on SQLite/files: callers run it off the event loop.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Mapping

import diskcache

from cache_tiers.storage import RawBytesDisk
from api.core.conversation import Message, ToolCall

log = logging.getLogger("pomona.responses")

DEFAULT_DIR = "~/.cache/pomona/responses"
RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")
FORMAT = 1  # bump when the stored shape changes; older rows are then misses


@dataclass(frozen=True)
class ResponseStoreSettings:
    enabled: bool = True
    directory: str | None = None
    size_bytes: int = 2**30
    max_age_s: float = 30 * 24 * 3600.0

    def __post_init__(self) -> None:
        if self.size_bytes < 2**20:
            raise ValueError("responses.size_bytes must be >= 1 MiB (the store's own database needs room)")
        if self.max_age_s <= 0:
            raise ValueError("responses.max_age_s must be > 0")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "ResponseStoreSettings":
        values = dict(values or {})
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown responses settings: {sorted(unknown)}; "
                             f"known: {sorted(f.name for f in fields(cls))}")
        return cls(**values)

    def resolved_directory(self, ssd_dir: str | None) -> str:
        if self.directory:
            return os.path.expanduser(self.directory)
        if ssd_dir:  # a sibling, not inside: the SSD tier owns (and may clear) its own directory
            path = Path(os.path.expanduser(ssd_dir))
            return str(path.with_name(path.name + "-responses"))
        return os.path.expanduser(DEFAULT_DIR)


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    messages: tuple[Message, ...]
    input_items: tuple[dict[str, Any], ...] = ()  # rows stored before input_items was kept: none
    tenant: str = ""  # who stored it; rows stored before tenants existed belong to "" (no keys)


def message_json(m: Message) -> dict[str, Any]:
    out = asdict(m)
    out["tool_calls"] = [asdict(c) for c in m.tool_calls]
    return {k: v for k, v in out.items() if v not in (None, [], "") or k in ("role", "content")}


def message_from_json(d: Mapping[str, Any]) -> Message:
    calls = tuple(ToolCall(str(c["id"]), str(c["name"]), str(c["arguments"])) for c in d.get("tool_calls", ()))
    return Message(role=d["role"], content=d.get("content", ""), tool_calls=calls,
                   tool_call_id=d.get("tool_call_id"), name=d.get("name"), reasoning=d.get("reasoning"))


def encode(stored: StoredResponse) -> bytes:
    body = {"format": FORMAT, "response": stored.response, "messages": [message_json(m) for m in stored.messages],
            "input_items": list(stored.input_items), "tenant": stored.tenant}
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def decode(raw: bytes) -> StoredResponse:
    body = json.loads(raw.decode("utf-8"))
    if body.get("format") != FORMAT:
        raise ValueError(f"stored format {body.get('format')!r}, expected {FORMAT}")
    items = body.get("input_items", [])
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ValueError("stored input_items is not a list of objects")
    tenant = body.get("tenant", "")
    if not isinstance(tenant, str):
        raise ValueError("stored tenant is not a string")
    return StoredResponse(body["response"], tuple(message_from_json(m) for m in body["messages"]), tuple(items),
                          tenant)


class ResponseStore:
    """The diskcache, opened on first use (a directory that cannot be created fails requests that
    need the store, not the application's start)."""

    def __init__(self, settings: ResponseStoreSettings, directory: str) -> None:
        self.settings, self.directory = settings, directory
        self._cache: diskcache.Cache | None = None
        self._lock = threading.Lock()

    def _open(self) -> diskcache.Cache:
        with self._lock:
            if self._cache is None:
                # "least-recently-stored": a read is then a plain SELECT, no bookkeeping write.
                self._cache = diskcache.Cache(self.directory, size_limit=self.settings.size_bytes,
                                              eviction_policy="least-recently-stored", disk=RawBytesDisk,
                                              statistics=False, timeout=5.0)
            return self._cache

    def put(self, rid: str, stored: StoredResponse) -> None:
        self._open().set(rid, encode(stored), expire=self.settings.max_age_s, retry=True)

    def get(self, rid: str, tenant: str = "") -> StoredResponse | None:
        """The stored response of `tenant`, or None when unknown, another tenant's, expired or unreadable."""
        if not RESPONSE_ID.match(rid):
            return None
        cache = self._open()
        try:
            raw = cache.get(rid, default=None, retry=True)  # RawBytesDisk: a pickled row raises, never loads
            stored = None if raw is None else decode(raw)
        except (ValueError, KeyError, TypeError) as exc:  # an older format, a damaged or foreign row
            log.warning("stored response %s is unreadable (%s); treating it as missing", rid, exc)
            return None
        return stored if stored is not None and stored.tenant == tenant else None

    def delete(self, rid: str, tenant: str = "") -> bool:
        """Delete `tenant`'s response; False when there is none of theirs under `rid`."""
        if self.get(rid, tenant) is None:
            return False
        return bool(self._open().delete(rid, retry=True))

    def volume(self) -> int:
        return self._open().volume()

    def close(self) -> None:
        with self._lock:
            if self._cache is not None:
                self._cache.close()
                self._cache = None
