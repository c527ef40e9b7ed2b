"""Prefix block hashes shared by the replicas (what they hold) and the request router (what a prompt needs).

Both sides call `prefix_hashes`, so the hashing is identical by construction. It is the prefix
cache's own chain (`cache_tiers.keys.block_chain`): the hash of block k covers every token before
it, so one string names a whole prefix and "replica R holds hash h" means "R can serve the prompt
up to that block". The seed is a fixed routing seed rather than the model fingerprint: all
replicas of a deployment serve one model, and the router has no model files to fingerprint.
No Ray here: the engine host imports it too.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from cache_tiers.keys import block_chain, chain_seed

ROUTING_SEED = chain_seed("pomona-routing")
HASH_BYTES = 8  # 16 hex chars: collisions only cost a misrouted request, never a wrong answer
MAX_PROMPT_BLOCKS = 64  # hash at most this many leading blocks of a prompt (bounds router CPU)
MAX_REPORTED_HASHES = 4096  # per replica, in each routing-stats report
MAX_REPORTED_ENTRIES = 256  # most recently used cache entries scanned for the report


def prefix_hashes(tokens: Sequence[int], block_size: int, max_blocks: int = MAX_PROMPT_BLOCKS) -> list[str]:
    """Hash of each complete leading block of `tokens` (element k names tokens[:(k+1)*block_size])."""
    if block_size <= 0:
        return []
    head = list(tokens[: max_blocks * block_size])
    return [d[:HASH_BYTES].hex() for d in block_chain(head, block_size, ROUTING_SEED)]


def held_hashes(entries: Iterable[Sequence[int]], block_size: int,
                limit: int = MAX_REPORTED_HASHES) -> list[str]:
    """Hashes of every block prefix of the cached entries, most recent entry first, deduplicated
    and capped: the bounded set a replica reports through its routing stats."""
    seen: dict[str, None] = {}
    for tokens in entries:
        for h in prefix_hashes(tokens, block_size):
            seen.setdefault(h, None)
            if len(seen) >= limit:
                return list(seen)
    return list(seen)


def prompt_tokens_of(args: Sequence[Any], kwargs: dict[str, Any]) -> list[int] | None:
    """The prompt token ids of an `LLMServer.generate(prompt_tokens, params, request_id)` call."""
    tokens = kwargs.get("prompt_tokens", args[0] if args else None)
    if isinstance(tokens, (list, tuple)) and all(isinstance(t, int) for t in tokens[:4]):
        return list(tokens)
    return None
