"""Frames between an LLM server replica and its engine's own process (engine_process.py / engine_worker.py).

A frame is a 4-byte big-endian length and a msgpack list `[kind, ...]`. msgpack rather than pickle:
the two processes exchange plain data only (events in api/core/wire.py's format, sampling dicts, stats),
so neither side ever runs code the other sent. Token arrays (the prefix store's held prefixes) travel
as raw bytes, not as lists of ints: converting thousands of ids to Python ints would hold the GIL
the engine's MLX thread needs.

Replica -> engine: ["config", engine settings] once; ["add", request_id, tokens, sampling, priority,
cache_salt] (the request's prefix-cache partition, `Request.cache_salt`);
["abort", request_id]; ["call", call_id, name, args].
Engine -> replica: ["ready", info] or ["failed", message] once; ["events", {request_id: [wire events]}]
(one frame per engine step); ["refused", request_id, kind, message, retry_after_s];
["reply", call_id, ok, value or message]; ["stats", stats].
"""

from __future__ import annotations

import asyncio
import enum
import struct
from dataclasses import asdict
from typing import Any, Mapping

import msgpack
import numpy as np

from engine.config import EngineConfig
from engine.types import ContextLengthError, EngineClosedError, InvalidRequestError, OverloadedError

_LENGTH = struct.Struct(">I")
_ARRAY = 1  # msgpack extension code: a numpy array as "dtype|" + raw bytes
# Refusals the engine raises before a request's first event, by the name that crosses the socket;
# the replica raises the same class, so EngineHost answers them exactly as it does in process.
REFUSALS: dict[str, type[Exception]] = {
    "overloaded": OverloadedError, "context_length": ContextLengthError,
    "closed": EngineClosedError, "invalid": InvalidRequestError,
}


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        array = np.ascontiguousarray(obj)
        return msgpack.ExtType(_ARRAY, array.dtype.str.encode() + b"|" + array.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    raise TypeError(f"cannot send {type(obj).__name__} to or from the engine process")


def _ext(code: int, data: bytes) -> Any:
    if code == _ARRAY:
        dtype, _, raw = data.partition(b"|")
        return np.frombuffer(raw, dtype=np.dtype(dtype.decode()))
    return msgpack.ExtType(code, data)


def pack(message: list[Any]) -> bytes:
    body = msgpack.packb(message, default=_default, use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


async def receive(reader: asyncio.StreamReader) -> list[Any] | None:
    """The next frame, or None at the end of the stream (the other process is gone)."""
    try:
        head = await reader.readexactly(_LENGTH.size)
        body = await reader.readexactly(_LENGTH.unpack(head)[0])
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    return msgpack.unpackb(body, ext_hook=_ext, raw=False, strict_map_key=False)


def config_to_wire(config: EngineConfig) -> dict[str, Any]:
    return asdict(config)


def config_from_wire(values: Mapping[str, Any]) -> EngineConfig:
    return EngineConfig.from_dict(values)


def refusal_to_wire(exc: BaseException) -> tuple[str, str, float]:
    """(kind, message, retry_after_s) of an exception raised before the first event; kind "error"
    is anything that is not one of the engine's refusals: the server's fault, a 5xx."""
    for kind, cls in REFUSALS.items():
        if type(exc) is cls:
            return kind, str(exc), float(getattr(exc, "retry_after_s", 0.0))
    return "error", f"{type(exc).__name__}: {exc}", 0.0


def refusal_from_wire(kind: str, message: str, retry_after_s: float) -> Exception:
    if kind == "overloaded":
        return OverloadedError(message, retry_after_s)
    if kind in REFUSALS:
        return REFUSALS[kind](message)
    return RuntimeError(f"the engine process failed this request: {message}")
