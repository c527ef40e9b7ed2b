"""Keys of the SSD tier: a hash chain over fixed token blocks, seeded by model and format.

Why a chain: the key of block k depends on every token before it, so one string names a whole
prefix, and all prefixes of a prompt are named by walking its blocks once (O(len) hashing, no
per-prefix rehash). Why a seed: state computed by another model (or written in an older layout)
must never be served, so the model fingerprint and `FORMAT_VERSION` enter the first hash and
every key of a different model or format is simply a different key.

The keys are an index, not a proof: a reader still checks the stored token ids against the
prompt (see codec), so even a hash collision cannot serve wrong state.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

# Bump whenever the serialized layout (codec) or the key scheme changes.
FORMAT_VERSION = 2  # 2: layers as generic state trees (any mlx-lm cache class)
_DIGEST = 16


def chain_seed(fingerprint: str, version: int | None = None) -> bytes:
    """First link of every chain: binds the keys to one model and one on-disk format."""
    version = FORMAT_VERSION if version is None else version
    return hashlib.blake2b(f"pomona-kv|{version}|{fingerprint}".encode(), digest_size=_DIGEST).digest()


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


def entry_key(digest: bytes) -> str:
    """Key of a stored entry that ends exactly at the block named by `digest`."""
    return "e/" + digest.hex()


def marker_key(digest: bytes) -> str:
    """Key of a marker saying "some entry extends through this block"; its value is that entry's key."""
    return "m/" + digest.hex()


def exact_marker_key(digest: bytes) -> str:
    """Key of a marker saying "some exact (non-trimmable) entry ends at or past this block"."""
    return "x/" + digest.hex()
