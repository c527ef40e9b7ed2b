"""Snapshots <-> safetensors bytes, split so that the SSD writer thread never calls MLX.

`to_host` (MLX thread) exposes a snapshot's evaluated arrays as numpy views (zero-copy; the views
keep the MLX buffers alive, and snapshots are never mutated). `encode` (writer thread) turns
them into safetensors bytes with `safetensors.numpy`; `decode` (MLX thread, on an SSD hit) parses
and validates them; `from_host` builds MLX arrays again. Nothing is pickled. A decoded entry is
trusted only after its format version, model fingerprint, structure and shapes check out; any
failure is a `CorruptEntry`, which the SSD tier turns into "delete and count".
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import safetensors.numpy as stn

from . import keys
from .snapshot import SUPPORTED, LayerSnapshot, Snapshot

_META = "pomona"
_ST_DTYPES = {"float32": "F32", "float16": "F16", "uint16": "U16", "uint32": "U32", "int64": "I64",
              "int32": "I32", "uint8": "U8", "int8": "I8", "float64": "F64"}


class CorruptEntry(ValueError):
    """Stored bytes that do not decode to a valid entry for this model and format."""


@dataclass(frozen=True, eq=False)
class HostEntry:
    """Numpy views of a snapshot plus a JSON-able description of its layers."""

    tensors: dict[str, np.ndarray]
    meta: dict[str, Any]

    @property
    def tokens(self) -> np.ndarray:
        return self.tensors["tokens"]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _host(a: mx.array, name: str, tensors: dict[str, np.ndarray], bf16: list[str]) -> str:
    if a.dtype == mx.bfloat16:  # numpy has no bfloat16: ship the bits, remember the type
        a = mx.view(a, mx.uint16)
        mx.eval(a)
        bf16.append(name)
    tensors[name] = np.asarray(a)
    return name


def to_host(snap: Snapshot) -> HostEntry:
    """MLX thread: numpy views of the snapshot's arrays (no copy) and the layer layout."""
    tensors: dict[str, np.ndarray] = {"tokens": snap.tokens}
    bf16: list[str] = []
    layers = []
    for i, layer in enumerate(snap.layers):
        slots: list[list[Any]] = []
        for j, s in enumerate(layer.slots):
            if isinstance(s, mx.array):
                slots.append(["a", _host(s, f"{i}.{j}", tensors, bf16)])
            elif isinstance(s, tuple):
                slots.append(["t", [_host(a, f"{i}.{j}.{k}", tensors, bf16) for k, a in enumerate(s)]])
            else:
                slots.append(["s", s])
        layers.append({"cls": layer.cls, "slots": slots})
    meta = {"version": keys.FORMAT_VERSION, "trimmable": snap.trimmable, "layers": layers, "bf16": bf16}
    return HostEntry(tensors, meta)


def encode(entry: HostEntry, fingerprint: str) -> bytes:
    """Writer thread: safetensors bytes with the layout and fingerprint in the header."""
    # Written by hand (the format is a JSON header plus raw little-endian data) because
    # `safetensors.numpy.save` serializes and then copies once more, doubling the writer's
    # memory traffic. Views cut to a block boundary are made dense here, on the writer thread.
    # A CRC32 of the data section (~0.25 ms/MB) catches bit rot and torn writes that would
    # otherwise decode to plausible but wrong floats.
    header: dict[str, Any] = {}
    chunks: list[memoryview] = []
    offset = crc = 0
    for name, t in entry.tensors.items():
        dense = np.ascontiguousarray(t, dtype=t.dtype.newbyteorder("<"))
        header[name] = {"dtype": _ST_DTYPES[dense.dtype.name], "shape": list(dense.shape),
                        "data_offsets": [offset, offset + dense.nbytes]}
        offset += dense.nbytes
        chunks.append(memoryview(dense).cast("B"))
        crc = zlib.crc32(chunks[-1], crc)
    meta = dict(entry.meta, fingerprint=fingerprint, crc32=crc)
    header["__metadata__"] = {_META: json.dumps(meta)}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return b"".join([struct.pack("<Q", len(head)), head, *chunks])


def _header_meta(data: bytes) -> dict[str, Any]:
    if len(data) < 8:
        raise CorruptEntry("too short")
    (hlen,) = struct.unpack("<Q", data[:8])
    if hlen > len(data) - 8 or hlen > 1 << 24:
        raise CorruptEntry("bad header length")
    header = json.loads(data[8 : 8 + hlen])
    meta = json.loads(header["__metadata__"][_META])
    if zlib.crc32(memoryview(data)[8 + hlen :]) != meta.get("crc32"):
        raise CorruptEntry("checksum mismatch")
    return meta


def decode(data: bytes, fingerprint: str) -> HostEntry:
    """Parse and validate stored bytes; raise CorruptEntry for anything not exactly right."""
    try:
        meta = _header_meta(data)
        if meta.get("version") != keys.FORMAT_VERSION or meta.get("fingerprint") != fingerprint:
            raise CorruptEntry("entry of another format or model")
        tensors = stn.load(data)
        _validate(tensors, meta)
    except CorruptEntry:
        raise
    except Exception as e:  # malformed JSON, truncated tensors, missing names, bad shapes...
        raise CorruptEntry(f"{type(e).__name__}: {e}") from e
    return HostEntry(tensors, meta)


def _validate(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    tokens = tensors["tokens"]
    if tokens.ndim != 1 or tokens.dtype != np.int64 or tokens.shape[0] == 0:
        raise CorruptEntry("bad tokens")
    n = int(tokens.shape[0])
    for layer in meta["layers"]:
        if layer["cls"] not in SUPPORTED:
            raise CorruptEntry(f"unknown class {layer['cls']}")
        slots = layer["slots"]
        if slots[2] != ["s", n]:
            raise CorruptEntry("offset does not match tokens")
        names = [s[1] for s in slots if s[0] == "a"] + [x for s in slots if s[0] == "t" for x in s[1]]
        for name in names:
            if tensors[name].ndim != 4:
                raise CorruptEntry("bad array rank")
            if layer["cls"] != "RotatingKVCache" and tensors[name].shape[2] != n:
                raise CorruptEntry("array length does not match tokens")


def _device(name: str, entry: HostEntry) -> mx.array:
    a = mx.array(entry.tensors[name])
    return mx.view(a, mx.bfloat16) if name in entry.meta["bf16"] else a


def from_host(entry: HostEntry) -> Snapshot:
    """MLX thread: rebuild an evaluated Snapshot from a decoded entry."""
    layers = []
    for layer in entry.meta["layers"]:
        slots: list[Any] = []
        for kind, val in layer["slots"]:
            if kind == "a":
                slots.append(_device(val, entry))
            elif kind == "t":
                slots.append(tuple(_device(v, entry) for v in val))
            else:
                slots.append(val)
        layers.append(LayerSnapshot(layer["cls"], tuple(slots)))
    arrays = [a for l in layers for s in l.slots for a in (s if isinstance(s, tuple) else (s,))
              if isinstance(a, mx.array)]
    mx.eval(*arrays)
    tokens = np.array(entry.tokens, dtype=np.int64)
    nbytes = sum(a.nbytes for a in arrays) + tokens.nbytes
    return Snapshot(tokens, tuple(layers), nbytes, bool(entry.meta["trimmable"]))
