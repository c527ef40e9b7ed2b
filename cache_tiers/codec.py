"""Blocks and exact states <-> safetensors bytes, split so that the SSD writer thread never calls MLX.

`prepare_block` / `prepare_state` (MLX thread, at the offer) name a block's arrays and start
bfloat16 ones as uint16 views (numpy has no bfloat16) with `mx.async_eval`, waiting for nothing.
`to_host` (MLX thread, a step later, when the arrays are long computed) exposes them as numpy
views: no copy and no wait. `encode` (writer thread) writes safetensors bytes; `decode_block` /
`decode_state` (on an SSD hit) parse and validate them, and build MLX arrays again; a block's parse
(`parse_block`) calls no MLX, so a reader thread can do it and leave the MLX thread only `to_block`. Nothing is
pickled. A decoded row is trusted only after its checksum, format version, model fingerprint,
digest, structure and shapes check out; any failure is a `CorruptEntry`, which the SSD tier
turns into "delete and count".
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
from .blocks import Block, ExactState, Layout, Tail
from .layer_state import CACHE_CLASSES, SCALARS, LayerSnapshot, cut_layer, layer_lengths, leaves

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


@dataclass(frozen=True, eq=False)
class Prepared:
    """A block or state named for storage, its arrays still MLX (bfloat16 ones as started uint16
    views); `to_host` turns it into a `HostEntry` once they are computed."""

    arrays: dict[str, Any]  # name -> mx.array or np.ndarray
    meta: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values())


_BITS = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def private_copy(a: mx.array, stream: Any = None) -> mx.array:
    """A bit-exact copy of `a` in a buffer of its own (an integer add of 0 on its bits: no float
    rounding, NaN payloads kept), made on `stream` (None: the default one). See `prepare_block`'s
    `private`."""
    bits = _BITS[a.itemsize]
    if a.dtype == bits:
        return mx.add(a, 0, stream=stream)
    return mx.view(mx.add(mx.view(a, bits), 0, stream=stream), a.dtype)


# `private` values: False (the writer reads the arrays themselves), True (device copies), or STAGED.
STAGED = "staged"


def _name(a: Any, name: str, arrays: dict[str, Any], bf16: list[str], private: bool | str = False) -> str:
    if isinstance(a, mx.array) and private:
        a = private_copy(a)
        if private == STAGED:  # the host copy made by MLX's CPU stream from the device copy
            a = private_copy(a, stream=mx.cpu)
    if isinstance(a, mx.array) and a.dtype == mx.bfloat16:  # numpy has no bfloat16: ship the bits
        a = mx.view(a, mx.uint16)
        bf16.append(name)
    arrays[name] = a
    return name


def _layout(tree: Any, prefix: str, arrays: dict[str, Any], bf16: list[str], private: bool | str) -> dict[str, Any]:
    """A JSON-able description of a state tree; arrays go to `arrays` under `prefix.k` names.
    Lists and tuples stay apart: mlx-lm's `from_state` setters rely on which is which (an
    `ArraysCache` assigns into its list)."""
    if isinstance(tree, mx.array):
        return {"a": _name(tree, f"{prefix}.{len(arrays)}", arrays, bf16, private)}
    if isinstance(tree, (list, tuple)):
        return {"l" if isinstance(tree, list) else "t": [_layout(t, prefix, arrays, bf16, private) for t in tree]}
    return {"s": tree}


def _started(arrays: dict[str, Any], meta: dict[str, Any]) -> Prepared:
    mx.async_eval([a for a in arrays.values() if isinstance(a, mx.array)])
    return Prepared(arrays, meta)


def prepare_block(block: Block, private: bool | str = False) -> Prepared:
    """MLX thread: a block's arrays named for storage, started, not waited for.

    `private`: the arrays the writer reads are copies, not the block's own; STAGED: copies of those
    copies made by MLX's CPU stream, so that the device-to-host transfer a host read makes (see
    below) runs in MLX's CPU worker, not at `to_host` on the engine's MLX thread (a synchronous
    `cudaMemcpy` there). Why copies at all: on MLX's CUDA
    backend a host read of an array (`to_host`: numpy's view of it) moves its buffer out of device
    memory into managed memory for good, so every later GPU read of the block (a RAM hit's
    restore) pulls its pages back over the bus, and its buffer, once freed, is handed to new
    arrays the GPU writes with the same cost (benchmarks/device/host_reads.py on the H200: a
    restore of host-read blocks 22x slower, new arrays in their buffers 23x). The copies take that
    instead; `SsdTier` frees them where the engine's allocations cannot get their buffers."""
    arrays: dict[str, Any] = {"tokens": block.tokens}
    bf16: list[str] = []
    for g, x in enumerate(block.arrays):
        if block.quant is None:
            _name(x, f"g{g}", arrays, bf16, private)
        else:
            for part, name in zip(x, ("q", "s", "b")):
                _name(part, f"g{g}.{name}", arrays, bf16, private)
    meta = {"version": keys.FORMAT_VERSION, "kind": "block", "digest": block.digest.hex(),
            "parent": None if block.parent is None else block.parent.hex(), "layout": block.layout.as_json(),
            "quant": None if block.quant is None else list(block.quant), "bf16": bf16}
    return _started(arrays, meta)


def prepare_tail(tail: Tail, private: bool | str = False) -> Prepared:
    """MLX thread: a KV tail's arrays (the tokens past its parent block, never quantized) named for
    storage under its parent, started, not waited for. Tails with an exact state are not stored.
    `private`: as `prepare_block`'s."""
    if tail.parent is None or tail.state is not None:
        raise ValueError("only a KV tail under a block is stored")
    arrays: dict[str, Any] = {"tokens": tail.tokens}
    bf16: list[str] = []
    for g, x in enumerate(tail.arrays):
        _name(x, f"g{g}", arrays, bf16, private)
    meta = {"version": keys.FORMAT_VERSION, "kind": "tail", "digest": tail.parent.hex(), "parent": tail.parent.hex(),
            "layout": tail.layout.as_json(), "quant": None, "bf16": bf16}
    return _started(arrays, meta)


def prepare_state(state: ExactState, private: bool | str = False) -> Prepared:
    """MLX thread: an exact state's arrays named for storage, started, not waited for.
    `private`: as `prepare_block`'s."""
    arrays: dict[str, Any] = {}
    bf16: list[str] = []
    layers = [{"index": i, "cls": layer.cls, "state": _layout(layer.slots, str(i), arrays, bf16, private)}
              for i, layer in state.layers]
    meta = {"version": keys.FORMAT_VERSION, "kind": "state", "digest": state.digest.hex(),
            "num_tokens": state.num_tokens, "num_layers": state.num_layers, "layers": layers, "bf16": bf16}
    return _started(arrays, meta)


def to_host(prepared: Prepared) -> HostEntry:
    """MLX thread, after the arrays are computed: numpy views of them (no copy, no wait)."""
    return HostEntry({k: a if isinstance(a, np.ndarray) else np.asarray(a) for k, a in prepared.arrays.items()},
                     prepared.meta)


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


def _checked(data: bytes, fingerprint: str, kind: str, digest: bytes) -> tuple[dict[str, np.ndarray], dict]:
    meta = _header_meta(data)
    if meta.get("version") != keys.FORMAT_VERSION or meta.get("fingerprint") != fingerprint:
        raise CorruptEntry("entry of another format or model")
    if meta.get("kind") != kind or meta.get("digest") != digest.hex():
        raise CorruptEntry(f"not the {kind} stored under this key")
    return stn.load(data), meta


def _array(tensors: dict[str, np.ndarray], meta: dict[str, Any], name: str) -> mx.array:
    a = mx.array(tensors[name])
    return mx.view(a, mx.bfloat16) if name in meta["bf16"] else a


@dataclass(frozen=True, eq=False)
class ParsedBlock:
    """A stored block (or tail: `parse_tail`) read, checked and parsed, its arrays still numpy: what
    a reader thread hands the MLX thread, which only wraps them (`to_block`, `to_tail`). No MLX call
    makes one."""

    digest: bytes
    parent: bytes | None
    tokens: np.ndarray
    layout: Layout
    quant: tuple[int, int] | None
    tensors: dict[str, np.ndarray]
    meta: dict[str, Any]


def parse_block(data: bytes, fingerprint: str, digest: bytes, block_size: int) -> ParsedBlock:
    """Parse and validate a stored block (no MLX: any thread); raise CorruptEntry for anything not
    exactly right."""
    try:
        tensors, meta = _checked(data, fingerprint, "block", digest)
        tokens = tensors["tokens"]
        if tokens.shape != (block_size,) or tokens.dtype != np.int64:
            raise CorruptEntry("bad tokens")
        layout = Layout.from_json(meta["layout"])
        quant = None if meta["quant"] is None else (int(meta["quant"][0]), int(meta["quant"][1]))
        for g, group in enumerate(layout.groups):
            parts = [tensors[name] for name in _group_names(g, quant)]
            if any(p.ndim != 4 or p.shape[:3] != (len(group), parts[0].shape[1], block_size) for p in parts):
                raise CorruptEntry("array shape does not match the layout")
        parent = meta["parent"]
        parent_digest = None if parent is None else bytes.fromhex(parent)
    except CorruptEntry:
        raise
    except Exception as e:  # malformed JSON, truncated tensors, missing names, bad shapes...
        raise CorruptEntry(f"{type(e).__name__}: {e}") from e
    return ParsedBlock(digest, parent_digest, np.array(tokens), layout, quant, tensors, meta)


def parse_tail(data: bytes, fingerprint: str, parent: bytes, block_size: int) -> ParsedBlock:
    """Parse and validate a stored tail (no MLX: any thread): 1 .. block_size - 1 tokens under
    block `parent`; raise CorruptEntry for anything not exactly right."""
    try:
        tensors, meta = _checked(data, fingerprint, "tail", parent)
        tokens = tensors["tokens"]
        if tokens.ndim != 1 or not 0 < len(tokens) < block_size or tokens.dtype != np.int64:
            raise CorruptEntry("bad tokens")
        if meta["parent"] != parent.hex() or meta["quant"] is not None:
            raise CorruptEntry("not a tail of this block")
        layout = Layout.from_json(meta["layout"])
        for g, group in enumerate(layout.groups):
            x = tensors[f"g{g}"]
            if x.ndim != 4 or x.shape[0] != len(group) or x.shape[2] != len(tokens):
                raise CorruptEntry("array shape does not match the layout")
    except CorruptEntry:
        raise
    except Exception as e:  # malformed JSON, truncated tensors, missing names, bad shapes...
        raise CorruptEntry(f"{type(e).__name__}: {e}") from e
    return ParsedBlock(parent, parent, np.array(tokens), layout, None, tensors, meta)


def to_tail(parsed: ParsedBlock) -> Tail:
    """The MLX arrays of a parsed tail (MLX thread)."""
    arrays = tuple(_array(parsed.tensors, parsed.meta, f"g{g}") for g in range(len(parsed.layout.groups)))
    mx.eval(list(arrays))
    nbytes = sum(x.nbytes for x in arrays) + parsed.tokens.nbytes
    return Tail(parsed.parent, parsed.tokens, parsed.layout, arrays, None, nbytes)


def to_block(parsed: ParsedBlock) -> Block:
    """The MLX arrays of a parsed block (MLX thread)."""
    arrays: list[Any] = []
    for g in range(len(parsed.layout.groups)):
        xs = tuple(_array(parsed.tensors, parsed.meta, name) for name in _group_names(g, parsed.quant))
        arrays.append(xs[0] if parsed.quant is None else xs)
    mx.eval([x for x in leaves(arrays)])
    nbytes = sum(x.nbytes for x in leaves(arrays)) + parsed.tokens.nbytes
    return Block(parsed.digest, parsed.parent, parsed.tokens, parsed.layout, tuple(arrays), parsed.quant, nbytes)


def decode_block(data: bytes, fingerprint: str, digest: bytes, block_size: int) -> Block:
    """Parse and validate a stored block; raise CorruptEntry for anything not exactly right."""
    return to_block(parse_block(data, fingerprint, digest, block_size))


def _group_names(g: int, quant: tuple[int, int] | None) -> list[str]:
    return [f"g{g}"] if quant is None else [f"g{g}.q", f"g{g}.s", f"g{g}.b"]


def decode_state(data: bytes, fingerprint: str, digest: bytes) -> ExactState:
    """Parse and validate a stored exact state; raise CorruptEntry for anything not exactly right."""
    try:
        tensors, meta = _checked(data, fingerprint, "state", digest)
        n, num_layers = int(meta["num_tokens"]), int(meta["num_layers"])
        layers = []
        for layer in meta["layers"]:
            cls, index = layer["cls"], int(layer["index"])
            if cls not in CACHE_CLASSES or not 0 <= index < num_layers:
                raise CorruptEntry(f"unknown class {cls} or layer {index}")
            state = _tree(layer["state"], tensors.__getitem__)
            if not isinstance(state, tuple) or any(length != n for length in layer_lengths(cls, state)):
                raise CorruptEntry("offset does not match tokens")
            cut_layer(cls, state, n, _exact_rows)
            layers.append((index, LayerSnapshot(cls, _tree(layer["state"], lambda name: _array(tensors, meta, name)))))
    except CorruptEntry:
        raise
    except Exception as e:
        raise CorruptEntry(f"{type(e).__name__}: {e}") from e
    arrays = [x for _, layer in layers for x in leaves(layer.slots)]
    mx.eval(arrays)
    return ExactState(digest, n, num_layers, tuple(layers), sum(a.nbytes for a in arrays))


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
