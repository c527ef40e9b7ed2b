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
from typing import Any, Callable

import mlx.core as mx
import numpy as np
import safetensors.numpy as stn

from . import keys
from .snapshot import (CACHE_CLASSES, SCALARS, LayerSnapshot, Snapshot, cut_layer, is_trimmable, layer_lengths,
                       leaves)

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


def _layout(tree: Any, prefix: str, tensors: dict[str, np.ndarray], bf16: list[str]) -> dict[str, Any]:
    """A JSON-able description of a state tree; arrays go to `tensors` under `prefix.k` names.
    Lists and tuples stay apart: mlx-lm's `from_state` setters rely on which is which (an
    `ArraysCache` assigns into its list)."""
    if isinstance(tree, mx.array):
        return {"a": _host(tree, f"{prefix}.{len(tensors)}", tensors, bf16)}
    if isinstance(tree, (list, tuple)):
        return {"l" if isinstance(tree, list) else "t": [_layout(t, prefix, tensors, bf16) for t in tree]}
    return {"s": tree}


def to_host(snap: Snapshot) -> HostEntry:
    """MLX thread: numpy views of the snapshot's arrays (no copy) and the layer layout."""
    tensors: dict[str, np.ndarray] = {"tokens": snap.tokens}
    bf16: list[str] = []
    layers = [{"cls": layer.cls, "state": _layout(layer.slots, str(i), tensors, bf16)}
              for i, layer in enumerate(snap.layers)]
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


def _tree(node: Any, leaf: Callable[[str], Any]) -> Any:
    """Rebuild a state tree from its layout; `leaf` turns a tensor name into an array."""
    if not isinstance(node, dict) or len(node) != 1:
        raise CorruptEntry("bad layout node")
    [(kind, value)] = node.items()
    if kind == "a" and isinstance(value, str):
        return leaf(value)
    if kind in ("l", "t") and isinstance(value, list):
        items = [_tree(v, leaf) for v in value]
        return items if kind == "l" else tuple(items)
    if kind == "s" and isinstance(value, SCALARS):
        return value
    raise CorruptEntry("bad layout node")


def _exact_rows(x: np.ndarray, rows: int | None) -> np.ndarray:
    if rows is not None and x.shape[-2] != rows:
        raise CorruptEntry("array length does not match tokens")
    return x


def _validate(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Every layer a known class whose recorded lengths and token rows match the tokens, and the
    trimmable flag what the layers say (a wrong flag would serve state at a wrong length)."""
    tokens = tensors["tokens"]
    if tokens.ndim != 1 or tokens.dtype != np.int64 or tokens.shape[0] == 0:
        raise CorruptEntry("bad tokens")
    n = int(tokens.shape[0])
    trimmable = True
    for layer in meta["layers"]:
        cls = layer["cls"]
        if cls not in CACHE_CLASSES:
            raise CorruptEntry(f"unknown class {cls}")
        state = _tree(layer["state"], tensors.__getitem__)
        if not isinstance(state, tuple) or any(length != n for length in layer_lengths(cls, state)):
            raise CorruptEntry("offset does not match tokens")
        cut_layer(cls, state, n, _exact_rows)
        trimmable = trimmable and is_trimmable(cls, state)
    if meta["trimmable"] is not trimmable:
        raise CorruptEntry("trimmable flag does not match the layers")


def _device(name: str, entry: HostEntry) -> mx.array:
    a = mx.array(entry.tensors[name])
    return mx.view(a, mx.bfloat16) if name in entry.meta["bf16"] else a


def from_host(entry: HostEntry) -> Snapshot:
    """MLX thread: rebuild an evaluated Snapshot from a decoded (validated) entry."""
    layers = tuple(LayerSnapshot(layer["cls"], _tree(layer["state"], lambda name: _device(name, entry)))
                   for layer in entry.meta["layers"])
    arrays = [a for layer in layers for a in leaves(layer.slots)]
    mx.eval(*arrays)
    tokens = np.array(entry.tokens, dtype=np.int64)
    nbytes = sum(a.nbytes for a in arrays) + tokens.nbytes
    return Snapshot(tokens, layers, nbytes, bool(entry.meta["trimmable"]))
