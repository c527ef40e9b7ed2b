"""RAM tier: blocks by chain digest under a byte budget, evicted leaf first, least recently used.

Why blocks (and not whole prefixes, as this tier kept before): a conversation's turns share all
but their last tokens, and so do an agent's sessions with the same system prompt and tools. A
block is held once whatever the number of conversations that reach it, so the tier's bytes are
the distinct tokens it holds, and an offer adds only the blocks it lacks.

Why leaf first: a block is useful only with every block before it (its digest names that whole
prefix). Evicting only blocks no other held block extends keeps what is held prefix-closed: a
block here implies its whole chain is here, so a lookup walks the chain until the first miss and
never finds a gap. Among the leaves the least recently used goes first; a hit touches its whole
chain, root to leaf, so a chain in use is newer than any leaf that is not.

Exact states (a hybrid model's state-space layers at a block boundary) live beside the block they
end, and leave with it; so do tails (blocks.Tail: an offer's tokens past its last whole block, a
few per block, RAM only). Each eviction of a block or state is handed to `on_evict` (the SSD tier
takes what it lacks).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from .blocks import Block, ExactState, Tail
from .stats import TierCounters

TAILS_PER_BLOCK = 4  # tails kept under one block (most recent): siblings of one conversation
ROOT_TAILS = 16  # tails of offers shorter than a block (a system prompt alone)

EvictHook = Callable[["Block | ExactState", bool], None]  # (what left, already persisted)


@dataclass(eq=False)
class _Node:
    block: Block
    persisted: bool
    used: int  # recency stamp
    children: int = 0
    state: ExactState | None = None
    state_persisted: bool = False
    under: bytes = b""  # the parent's digest, or for a first block the chain seed
    tails: list[Tail] = field(default_factory=list)  # most recent last


@dataclass
class RamTier:
    budget: int
    on_evict: EvictHook | None = None
    counters: TierCounters = field(default_factory=TierCounters)
    nbytes: int = 0

    def __post_init__(self) -> None:
        self._nodes: dict[bytes, _Node] = {}
        self._leaves: list[tuple[int, bytes]] = []  # heap of (used, digest); stale entries skipped
        self._clock = itertools.count(1)
        # Offers shorter than a block, by the chain seed (model, format, salt) they start from: one
        # tenant's never answer another's lookups.
        self._root_tails: OrderedDict[bytes, list[Tail]] = OrderedDict()
        self._kids: dict[bytes, set[bytes]] = {}  # parent digest (a first block: its seed) -> held blocks
        # Nodes whose block or state the SSD has not taken yet, oldest first: a parent is always
        # added before its children, so this order writes a chain root to leaf (what a reader
        # after a restart can use: it stops at the first gap).
        self._unwritten: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def states(self) -> int:
        return sum(1 for node in self._nodes.values() if node.state is not None)

    # -- lookups --------------------------------------------------------------------------------
    def reach(self, chain: Sequence[bytes], tokens: np.ndarray | None = None, block_size: int = 0) -> int:
        """How many leading blocks of `chain` are held (prefix-closed: the first miss ends it).
        With the prompt's `tokens`, a held block must also hold the prompt's own token ids there:
        the digest is an index, not a proof, so even a hash collision cannot serve wrong state."""
        k = 0
        for digest in chain:
            node = self._nodes.get(digest)
            if node is None or (tokens is not None and not np.array_equal(
                    node.block.tokens, tokens[k * block_size:(k + 1) * block_size])):
                break
            k += 1
        return k

    def state_at(self, digest: bytes) -> ExactState | None:
        node = self._nodes.get(digest)
        return None if node is None else node.state

    def blocks(self, chain: Sequence[bytes]) -> list[Block]:
        """The held blocks of `chain` (all must be held), touched root to leaf."""
        out = []
        for digest in chain:
            node = self._nodes[digest]
            self._touch(node)
            out.append(node.block)
        return out

    # -- insertion ------------------------------------------------------------------------------
    def add(self, block: Block, persisted: bool, root: bytes = b"") -> bool:
        """Hold `block` (its parent must be held: the tier stays prefix-closed); False when it does
        not fit at all. A block already held is only touched (stored once)."""
        node = self._nodes.get(block.digest)
        if node is not None:
            node.persisted = node.persisted or persisted
            self._settle(node)
            self._touch(node)
            return True
        if block.parent is not None and block.parent not in self._nodes:
            self.counters.rejected += 1
            return False
        if block.nbytes > self.budget:
            self.counters.rejected += 1
            return False
        node = _Node(block, persisted, next(self._clock), under=block.parent if block.parent is not None else root)
        self._nodes[block.digest] = node
        if not persisted:
            self._unwritten[block.digest] = None
        self._kids.setdefault(node.under, set()).add(block.digest)
        if block.parent is not None:
            self._nodes[block.parent].children += 1
        self.nbytes += block.nbytes
        heapq.heappush(self._leaves, (node.used, block.digest))
        self._enforce_budget(keep=block.digest)
        return block.digest in self._nodes

    def add_state(self, state: ExactState, persisted: bool) -> bool:
        """Hold an exact state beside the block it ends (which must be held)."""
        node = self._nodes.get(state.digest)
        if node is None or state.nbytes > self.budget:
            self.counters.rejected += 1
            return False
        if node.state is not None:
            node.state_persisted = node.state_persisted or persisted
            self._settle(node)
            self._touch(node)
            return True
        node.state, node.state_persisted = state, persisted
        if not persisted:
            self._unwritten[state.digest] = None
        self.nbytes += state.nbytes
        self._touch(node)
        self._enforce_budget(keep=state.digest)
        return state.digest in self._nodes

    def add_tail(self, tail: Tail, root: bytes = b"") -> bool:
        """Hold `tail` under its block (which must be held). A tail it extends is dropped (a KV
        tail serves any shorter prefix; an exact one only its own length, so only an equal one)."""
        if tail.parent is None:
            tails = self._root_tails.setdefault(root, [])
            self._root_tails.move_to_end(root)
        else:
            node = self._nodes.get(tail.parent)
            if node is None:
                return False
            tails = node.tails
            self._touch(node)
        for old in list(tails):
            covered = len(old.tokens) <= len(tail.tokens) and np.array_equal(old.tokens, tail.tokens[:len(old.tokens)])
            if covered and (tail.state is None or len(old.tokens) == len(tail.tokens)):
                tails.remove(old)
                self.nbytes -= old.nbytes
        tails.append(tail)
        self.nbytes += tail.nbytes
        while len(tails) > (ROOT_TAILS if tail.parent is None else TAILS_PER_BLOCK):
            self.nbytes -= tails.pop(0).nbytes
        self._enforce_budget(keep=tail.parent)
        return True

    def best_tail(self, parent: bytes | None, rest: np.ndarray, limit: int,
                  root: bytes = b"") -> tuple[Tail, int] | None:
        """The tail under `parent` serving the most of `rest` (the prompt past the block), at most
        `limit` tokens: a KV tail any common prefix, one with an exact state only its whole length."""
        tails = self._root_tails.get(root, []) if parent is None else getattr(self._nodes.get(parent), "tails", [])
        best: tuple[Tail, int] | None = None
        for tail in tails:
            m = min(len(tail.tokens), len(rest), limit)
            diff = np.flatnonzero(tail.tokens[:m] != rest[:m])
            common = int(diff[0]) if diff.size else m
            rows = common if tail.state is None else (len(tail.tokens) if common == len(tail.tokens) else 0)
            if rows > 0 and (best is None or rows > best[1]):
                best = (tail, rows)
        return best

    def best_partial(self, parent: bytes | None, rest: np.ndarray, limit: int,
                     root: bytes = b"") -> tuple[Block, int] | None:
        """The held block after `parent` sharing the most leading tokens with `rest` (the prompt past
        `parent`), at most `limit` of them: a prompt that diverges inside a block (a client renders
        the previous answer its own way) is still served up to the divergence, as a token trie
        would. Only for models without exact layers: a block's rows serve any prefix of it."""
        best: tuple[Block, int] | None = None
        for digest in self._kids.get(parent if parent is not None else root, ()):
            block = self._nodes[digest].block
            m = min(len(block.tokens), len(rest), limit)
            diff = np.flatnonzero(block.tokens[:m] != rest[:m])
            rows = int(diff[0]) if diff.size else m
            if rows > 0 and (best is None or rows > best[1]):
                best = (block, rows)
        if best is not None:
            self._touch(self._nodes[best[0].digest])
        return best

    # -- reports --------------------------------------------------------------------------------
    def recent_chains(self, limit: int) -> list[np.ndarray]:
        """Token ids of up to `limit` held chains, ending at the most recently used leaves first:
        what a request router needs to know this replica holds."""
        leaves = sorted((node for node in self._nodes.values() if node.children == 0),
                        key=lambda node: -node.used)[:max(0, limit)]
        return [self._tokens(node) for node in leaves]

    def _tokens(self, node: _Node) -> np.ndarray:
        parts = [node.block.tokens]
        while node.block.parent is not None:
            node = self._nodes[node.block.parent]
            parts.append(node.block.tokens)
        return np.concatenate(parts[::-1])

    def unpersisted(self, limit: int | None = None) -> Iterator[Block | ExactState]:
        """What the SSD has not taken yet, oldest first (a chain root to leaf, a block before the
        state it ends), from the first `limit` such blocks. Mark each taken with `persisted`; the
        iteration may stop anywhere."""
        digests = list(self._unwritten if limit is None else itertools.islice(self._unwritten, limit))
        for digest in digests:
            node = self._nodes.get(digest)
            if node is None:
                continue
            if not node.persisted:
                yield node.block
            if node.state is not None and not node.state_persisted:
                yield node.state

    @property
    def unwritten(self) -> int:
        """How many held blocks (or their states) the SSD has not taken yet."""
        return len(self._unwritten)

    def persisted(self, item: Block | ExactState) -> None:
        """`item` (held here) was handed to the SSD."""
        node = self._nodes.get(item.digest)
        if node is None:
            return
        if isinstance(item, Block):
            node.persisted = True
        elif node.state is item:
            node.state_persisted = True
        self._settle(node)

    def _settle(self, node: _Node) -> None:
        if node.persisted and (node.state is None or node.state_persisted):
            self._unwritten.pop(node.block.digest, None)

    # -- budget ---------------------------------------------------------------------------------
    def resize(self, budget_bytes: int) -> None:
        """New byte budget (e.g. when running requests need memory); evicts, and so demotes, down to it."""
        self.budget = budget_bytes
        self._enforce_budget()

    def clear(self) -> None:
        self._nodes.clear()
        self._kids.clear()
        self._leaves.clear()
        self._root_tails.clear()
        self._unwritten.clear()
        self.nbytes = 0

    def _enforce_budget(self, keep: bytes | None = None) -> None:
        held: list[tuple[int, bytes]] = []
        while self.nbytes > self.budget and self._leaves:
            used, digest = heapq.heappop(self._leaves)
            node = self._nodes.get(digest)
            if node is None or node.used != used or node.children:
                continue  # stale heap entry: touched since, evicted, or no longer a leaf
            if digest == keep and len(self._nodes) > 1:
                held.append((used, digest))  # the block being added goes last
                continue
            self._evict(node)
        for item in held:
            heapq.heappush(self._leaves, item)
        if self.nbytes > self.budget and keep in self._nodes:
            self._evict(self._nodes[keep])
        while self.nbytes > self.budget and self._root_tails:  # offers shorter than a block, oldest first
            seed, tails = next(iter(self._root_tails.items()))
            self.nbytes -= tails.pop(0).nbytes
            if not tails:
                del self._root_tails[seed]

    def _evict(self, node: _Node) -> None:
        block = node.block
        del self._nodes[block.digest]
        self._unwritten.pop(block.digest, None)  # `on_evict` below demotes what it holds
        kids = self._kids.get(node.under)
        if kids is not None:
            kids.discard(block.digest)
            if not kids:
                del self._kids[node.under]
        self.nbytes -= block.nbytes
        self.counters.evictions += 1
        if node.state is not None:
            self.nbytes -= node.state.nbytes
        self.nbytes -= sum(t.nbytes for t in node.tails)
        if block.parent is not None:
            parent = self._nodes[block.parent]
            parent.children -= 1
            if parent.children == 0:  # a leaf now: it may go next
                heapq.heappush(self._leaves, (parent.used, parent.block.digest))
        if self.on_evict is not None:
            self.on_evict(block, node.persisted)
            if node.state is not None:
                self.on_evict(node.state, node.state_persisted)

    def _touch(self, node: _Node) -> None:
        node.used = next(self._clock)
        if node.children == 0:
            heapq.heappush(self._leaves, (node.used, node.block.digest))
