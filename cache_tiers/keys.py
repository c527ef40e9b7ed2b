"""Keys of the prefix store: a hash chain over fixed token blocks, seeded by model, format and salt.

Why a chain: the key of block k depends on every token before it, so one string names a whole
prefix, and all prefixes of a prompt are named by walking its blocks once (O(len) hashing, no
per-prefix rehash). Why a seed: state computed by another model (or written in an older layout)
must never be served, so the model fingerprint and `FORMAT_VERSION` enter the first hash and
every key of a different model or format is simply a different key. A salt (the request's
`cache_salt`: its tenant) enters the seed too, as vLLM's `cache_salt` does: two tenants' chains
never meet, so neither can be served, or time, the other's prefixes.

Both tiers key blocks by their chain digest (content addressing, as vLLM's prefix caching and
LMCache do): the KV of a block is stored once, however many conversations share it.

The keys are an index, not a proof: a reader still checks the stored token ids against the
prompt (see codec), so even a hash collision cannot serve wrong state.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

# Bump whenever the serialized layout (codec) or the key scheme changes.
# 3: blocks of KV rows plus exact states at block boundaries (2: whole entries); tails ("t/") came
# later without a bump: a store of version 3 simply has none, and a reader of one never asks for them.
FORMAT_VERSION = 3
_DIGEST = 16


def chain_seed(fingerprint: str, version: int | None = None, salt: str = "") -> bytes:
    """First link of every chain: binds the keys to one model, one on-disk format and one salt
    (the empty salt keeps the seed of a store without tenants)."""
    version = FORMAT_VERSION if version is None else version
    text = f"pomona-kv|{version}|{fingerprint}" + (f"|salt|{salt}" if salt else "")
    return hashlib.blake2b(text.encode(), digest_size=_DIGEST).digest()


def block_chain(tokens: Sequence[int], block_size: int, seed: bytes) -> list[bytes]:
    """Digest after each complete block: element k-1 names the prefix tokens[: k * block_size]."""
    arr = np.asarray(tokens, dtype="<i8")
    digests: list[bytes] = []
    prev = seed
    for k in range(len(arr) // block_size):
        block = arr[k * block_size : (k + 1) * block_size].tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=_DIGEST).digest()
        digests.append(prev)
    return digests


def block_key(digest: bytes) -> str:
    """Key of the KV rows of the block whose chain digest is `digest`."""
    return "b/" + digest.hex()


def state_key(digest: bytes) -> str:
    """Key of an exact state (the layers that cannot be cut into blocks: a state-space layer's
    running summary, a rotated window) at the end of the block named by `digest`."""
    return "s/" + digest.hex()


def tail_key(parent: bytes) -> str:
    """Key of the tail stored under the block named by `parent`: the KV rows of the tokens an offer
    had past its last whole block (fewer than a block). One per block, the latest offer's: a
    restart then serves a repeated prompt whole, not up to its last block boundary."""
    return "t/" + parent.hex()
