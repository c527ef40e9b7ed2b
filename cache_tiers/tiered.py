"""The engine's `PrefixStore`: blocks in RAM first, then on the SSD; promote on SSD hits, demote
RAM evictions the SSD lacks.

Rules, each for a reason:
- Everything is keyed by the block chain (keys.py) of the request's salt: one tenant's chain
  never meets another's, so nothing is shared across salts.
- An offer cuts only the blocks RAM lacks from the offered cache (blocks.py) and hands each new
  block to the SSD once (write-through, content-addressed): a conversation's next turn writes its
  new tokens, not its history, and RAM holds a block once whoever reached it.
- The SSD is probed only when it could serve more than RAM does (from the block past RAM's run),
  so a full RAM hit costs no disk access.
- A hit shorter than `min_restore_tokens` is reported as a miss: copying in a few tokens of state
  saves less than it costs, and a short hit would still make the engine take the slower
  cache-restore admission path.
- An SSD hit's rows are read and parsed by a reader thread (`prefetch`) while the engine steps; the
  MLX thread only wraps them into RAM (`complete`), and the request is admitted from RAM after,
  reported as the SSD hit it is. (`restore` still reads whatever a match needs that no prefetch
  brought: a fallback, and the path of exact states, which are small.)
- A prefix is served in whole blocks plus, from RAM, a tail (the tokens an offer had past its
  last whole block), and leaves at least one prompt token to feed (mlx-lm needs one). The SSD
  keeps the latest tail under each block too (models without exact layers), and a prefetch reads
  the one past its run into RAM: after a restart a repeated prompt is served whole, not up to
  its last block boundary (the rest recomputed: up to a block's tokens). A model
  with exact layers (hybrid) is served only where an exact state lies: a block boundary, or the
  end of a tail.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import numpy as np

from . import blocks as blk
from .blocks import Block, ExactState, Tail
from .keys import block_chain, chain_seed
from .quant import QuantPolicy
from .ram import RamTier
from .ssd import SsdTier
from .stats import TierCounters
from .store import Hit, Match, OfferKind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Found:
    """What `find` saw, for `restore`: the chain, RAM's run, the SSD's run and exact states."""

    chain: tuple[bytes, ...]
    ram: int  # leading blocks RAM holds
    ram_state: int  # blocks up to RAM's deepest exact state (exact models), else == ram
    ssd: int  # leading blocks the SSD holds (0: not asked or none)
    ssd_state: int  # blocks up to the SSD's deepest exact state (exact models)
    tail: Tail | None = None  # RAM's tail under block `ram`, serving `tail_rows` more tokens
    tail_rows: int = 0
    seed: bytes = b""  # the chain's seed (its first block's place in RAM)


@dataclass(eq=False)
class Prefetch:
    """SSD rows of a match being read off the MLX thread (`TieredStore.prefetch`)."""

    found: _Found
    tokens: np.ndarray
    first: int  # the chain's blocks first .. last - 1 (RAM held the ones before when it started)
    last: int
    future: Future
    # What `complete` has done so far (it may take the rows over several steps):
    blocks_taken: int = 0  # blocks now held in RAM
    finished: bool = False  # everything read is taken, or dropped
    _rows: list[Any] | None = field(default=None, repr=False)  # the read's rows, once collected
    _tail: Any = field(default=None, repr=False)
    _next: int = 0  # the next row to take

    def done(self) -> bool:
        return self.future.done()

    def on_done(self, callback: Callable[[], None]) -> None:
        """Call `callback` (on the reader thread, or here if it is done) once the read ends."""
        self.future.add_done_callback(lambda _future: callback())


LANDED_MAX = 1024  # prefetched runs remembered until their restore (an aborted request's never comes)
# At shutdown, RAM's unwritten blocks are written for at most this long: Serve kills a replica
# `drain_s + 30` s after asking it to stop, and the engine's thread is waited for 30 s.
CLOSE_WRITE_S = 20.0
TAILS_DUE_MAX = 64  # finished tails the SSD's writer had no room for, kept (latest per block) until it has


class TieredStore:
    def __init__(self, ram: RamTier, ssd: SsdTier | None, block_size: int, min_restore_tokens: int,
                 fingerprint: str = "", ssd_error: str | None = None, quant: QuantPolicy | None = None,
                 ssd_write: str = "through") -> None:
        self.ram = ram
        self.ssd = ssd
        self.block_size = block_size
        self.min_restore_tokens = min_restore_tokens
        self.fingerprint = fingerprint
        self.ssd_error = ssd_error
        self.quant = quant
        self.write_through = ssd_write == "through"  # else "idle": new blocks reach the SSD at `tick(drain=True)`
        self.totals = TierCounters()
        self.too_short = 0
        self.blocks_offered = 0  # new blocks cut from offers (what the store paid to copy)
        self._seeds: dict[str, bytes] = {}
        self._last_chain: tuple[tuple[str, bytes], tuple[bytes, ...]] | None = None  # `_chain`'s memo
        # Whether the model has exact (uncuttable) layers: learned from the first offer or block
        # read; until then the SSD probe also asks for exact states.
        self._exact: bool | None = None
        ram.on_evict = self._demote
        self._reader_pool: ThreadPoolExecutor | None = None
        self._reader_lock = threading.Lock()
        # The last block of each run a prefetch brought into RAM: its restore is the SSD hit it is.
        self._landed: OrderedDict[bytes, None] = OrderedDict()
        # Finished tails the SSD's backlog was too full to take, by the block they continue.
        self._tails_due: OrderedDict[bytes, Tail] = OrderedDict()

    # -- lookups --------------------------------------------------------------------------------
    def _seed(self, salt: str) -> bytes:
        seed = self._seeds.get(salt)
        if seed is None:
            seed = self._seeds[salt] = chain_seed(self.fingerprint, salt=salt)
            if len(self._seeds) > 4096:  # tenants come and go: keep the memo bounded
                self._seeds = {salt: seed}
        return seed

    def _chain(self, tokens: np.ndarray, salt: str) -> tuple[bytes, ...]:
        """The block chain of `tokens`; the last one is kept, because `held` and the `offer` that
        follows it on this thread hash the same tokens (a 20k-token prompt: ~300 digests)."""
        key = (salt, np.asarray(tokens, dtype=np.int64).tobytes())
        if self._last_chain is not None and self._last_chain[0] == key:
            return self._last_chain[1]
        chain = tuple(block_chain(tokens, self.block_size, self._seed(salt)))
        self._last_chain = (key, chain)
        return chain

    def find(self, tokens: Sequence[int], salt: str = "", read_ssd: bool = True) -> Match | None:
        """The longest prefix RAM holds, or the SSD's rows promise past it (`read_ssd`: asked at all);
        nothing read or counted."""
        toks = np.asarray(tokens, dtype=np.int64)
        n = len(toks)
        if n < 2:
            return None
        limit = (n - 1) // self.block_size  # whole blocks, leaving a token to feed
        chain = self._chain(toks[:limit * self.block_size], salt)
        ram = self.ram.reach(chain, toks, self.block_size)
        if self._exact is None and ram:  # the blocks say whether the model has exact layers
            self._exact = self.ram.blocks(chain[:1])[0].layout.needs_exact
        ram_state = self._ram_state(chain, ram) if self._exact else ram
        ssd = ssd_state = 0
        if read_ssd and self.ssd is not None and ram_state < limit:
            ssd, ssd_state = self.ssd.probe(chain, ram + 1, self._exact, ram_state)
            if self._exact is False or (self._exact is None and ssd_state == 0):
                # No exact layers (or not known yet and the disk holds no exact state on this chain:
                # the restore reads the blocks and learns): the whole run serves.
                ssd_state = max(ssd_state, ssd)
        best = max(ram_state, ssd_state)
        num = best * self.block_size
        tier = "ram" if best <= ram_state else "ssd"
        found = _Found(chain, ram, ram_state, ssd, ssd_state, seed=self._seed(salt))
        parent, rest, room = chain[ram - 1] if ram else None, toks[ram * self.block_size:], n - 1 - ram * self.block_size
        seed = self._seed(salt)
        tail = self.ram.best_tail(parent, rest, room, seed)
        if not self._exact:  # a held block the prompt diverges inside serves up to there, if longer
            partial = self.ram.best_partial(parent, rest, room, seed)
            if partial is not None and (tail is None or partial[1] > tail[1]):
                tail = (blk.as_tail(partial[0]), partial[1])
        if tail is not None and ram * self.block_size + tail[1] > num:
            num, tier = ram * self.block_size + tail[1], "ram"
            found = _Found(chain, ram, ram_state, ssd, ssd_state, tail[0], tail[1], seed)
        if num == 0:
            return None
        return Match(num, tier, found, too_short=num < max(1, self.min_restore_tokens),
                     ram_tokens=num if tier == "ram" else ram * self.block_size)

    def _ram_state(self, chain: Sequence[bytes], ram: int) -> int:
        """Blocks up to the deepest exact state RAM holds on the chain (exact models)."""
        for k in range(ram, 0, -1):
            if self.ram.state_at(chain[k - 1]) is not None:
                return k
        return 0

    def restore(self, tokens: Sequence[int], match: Match | None, salt: str = "") -> Hit | None:
        """Copy what `find` found (reading SSD rows now); counted as one lookup of `tokens`."""
        toks = np.asarray(tokens, dtype=np.int64)
        n = len(toks)
        self.totals.query(n)
        if n < 2:
            return None
        self.ram.counters.query(n)
        if match is None or not isinstance(match.source, _Found):
            return None
        f: _Found = match.source
        if self.ssd is not None and f.ram_state < len(f.chain):
            self.ssd.counters.query(n)  # the SSD was asked (by `find`'s probe) whatever it answered
        if match.too_short:
            self.too_short += 1
            return None
        want = match.num_tokens // self.block_size
        tier: Literal["ram", "ssd"] = match.tier  # type: ignore[assignment]
        try:
            if f.tail is not None:
                return self._restore_tail(f)
            got = self._gather(f, toks, want, tier)
            if got is None and tier == "ssd":  # the SSD rows read shorter or damaged: RAM's part
                tier, got = "ram", self._gather(f, toks, f.ram_state, "ram") if f.ram_state else None
            if got is None:
                return None
            chain_blocks, state = got
            tail, rows = None, 0
            if tier == "ssd" and state is None and len(chain_blocks) == want:
                tail, rows = self._ssd_tail(f, toks, want)
            num = len(chain_blocks) * self.block_size + rows
            if num < max(1, self.min_restore_tokens):
                self.too_short += 1
                return None
            cache = blk.assemble(chain_blocks, state, chain_blocks[0].layout.num_layers, tail, rows)
            end = f.chain[len(chain_blocks) - 1]
            if tier == "ram" and end in self._landed:
                del self._landed[end]
                tier = "ssd"  # RAM holds it because a prefetch read it from the SSD for this request
        except Exception as e:  # never fail a request over the cache
            log.warning("prefix cache: cannot restore a %s prefix: %s", tier, e)
            (self.ram if tier == "ram" else self.ssd).counters.read_errors += 1  # type: ignore[union-attr]
            return None
        (self.ram if tier == "ram" else self.ssd).counters.hit(num)  # type: ignore[union-attr]
        self.totals.hit(num)
        return Hit(cache=cache, num_tokens=num, tier=tier)

    def _restore_tail(self, f: _Found) -> Hit | None:
        tail = f.tail
        assert tail is not None
        if self.ram.reach(f.chain[:f.ram]) < f.ram:  # gone since find (evicted by an offer in between)
            return None
        got = self.ram.blocks(f.chain[:f.ram])
        cache = blk.assemble(got, tail.state, tail.layout.num_layers, tail, f.tail_rows)
        num = f.ram * self.block_size + f.tail_rows
        tier: Literal["ram", "ssd"] = "ram"
        if f.ram and f.chain[f.ram - 1] in self._landed:  # a prefetch read the blocks (and the tail) for it
            del self._landed[f.chain[f.ram - 1]]
            tier = "ssd"
        (self.ram if tier == "ram" else self.ssd).counters.hit(num)  # type: ignore[union-attr]
        self.totals.hit(num)
        return Hit(cache=cache, num_tokens=num, tier=tier)

    def _ssd_tail(self, f: _Found, toks: np.ndarray, want: int) -> tuple[Tail | None, int]:
        """The SSD's tail past the chain's first `want` blocks (read now, held in RAM after) and how
        many of the prompt's tokens past them it serves; (None, 0) if it serves none."""
        assert self.ssd is not None
        parent = f.chain[want - 1]
        tail = self.ssd.take_tail(parent, self.ssd.read_tail(parent))
        if tail is None or not self.ram.add_tail(tail, f.seed):
            return None, 0
        self.ram.counters.promotions += 1
        start = want * self.block_size
        best = self.ram.best_tail(parent, toks[start:], len(toks) - 1 - start, f.seed)
        return best if best is not None else (None, 0)

    def _gather(self, f: _Found, toks: np.ndarray, want: int,
                tier: str) -> tuple[list[Block], ExactState | None] | None:
        """The chain's first `want` blocks (RAM's, then the SSD's, promoted) and, for a model with
        exact layers, the exact state at their end; None if they cannot all be had."""
        have = min(want, self.ram.reach(f.chain[:want]))
        got = self.ram.blocks(f.chain[:have])
        if want > have:
            if self.ssd is None or tier != "ssd":
                return None
            more = self.ssd.load_blocks(f.chain, toks, have, want)
            for b in more:
                if self.ram.add(b, persisted=True, root=f.seed):
                    self.ram.counters.promotions += 1
            got += more
        if not got:
            return None
        exact = got[0].layout.needs_exact
        self._exact = exact
        if not exact:  # a row missing or damaged part-way: the blocks before it still serve
            return got, None
        if len(got) < want:
            return None
        digest = f.chain[want - 1]
        state = self.ram.state_at(digest)
        if state is None and self.ssd is not None and tier == "ssd":
            state = self.ssd.load_state(digest)
            if state is not None and self.ram.add_state(state, persisted=True):
                self.ram.counters.promotions += 1
        return (got, state) if state is not None else None

    def prefetch(self, match: Match | None, tokens: Sequence[int]) -> Prefetch | None:
        """Start reading the SSD rows `match` needs past what RAM holds, on the reader thread (no
        MLX there, nothing changed): None when nothing needs reading."""
        if self.ssd is None or match is None or match.too_short or match.tier != "ssd" \
                or not isinstance(match.source, _Found) or match.source.tail is not None:
            return None
        f: _Found = match.source
        want = match.num_tokens // self.block_size
        have = min(want, self.ram.reach(f.chain[:want]))
        if have >= want:
            return None
        ssd, tail_under = self.ssd, f.chain[want - 1] if self._exact is not True else None
        future = self._reader().submit(lambda: (ssd.read_blocks(f.chain, have, want),
                                                ssd.read_tail(tail_under) if tail_under is not None else None))
        return Prefetch(f, np.asarray(tokens, dtype=np.int64), have, want, future)

    def complete(self, prefetch: Prefetch, budget_s: float | None = None) -> bool:
        """MLX thread, once `prefetch.done()`: check what was read against the prompt, make it MLX
        arrays and hold it in RAM (a later `find` sees it there); True once all of it is taken (or
        dropped: rows that are missing or damaged go as a restore drops them). With `budget_s`, it
        stops once it has spent about that long (always taking a block first) and returns False:
        the next call, a step later, goes on (and stops if RAM let the blocks before go meanwhile). Why: making a long hit's rows MLX arrays copies all
        of them (276 MB for 6,000 tokens of the default model in float32: 33-120 ms here), and the
        step that does it is a step every running request waits for."""
        p = prefetch
        if p.finished:
            return True
        if self.ssd is None:
            p.finished = True
            return True
        if p._rows is None:
            try:
                p._rows, p._tail = p.future.result()
            except Exception as e:  # read_blocks catches its own; anything else is a fault of ours, logged
                log.warning("prefix cache: SSD prefetch failed: %s", e)
                self.ssd.counters.read_errors += 1
                p.finished = True
                return True
            if p.first and self.ram.reach(p.found.chain[:p.first]) < p.first:
                p.finished = True  # RAM let the blocks before them go meanwhile: the restore reads what it needs
                return True
        started, chain, took = time.perf_counter(), p.found.chain, 0
        while p._next < len(p._rows):
            if budget_s is not None and took and time.perf_counter() - started >= budget_s:
                return False
            j = p.first + p._next
            got = self.ssd.take_blocks(chain, p.tokens, j, p.last, p._rows[p._next:p._next + 1])
            p._next += 1
            if not got:  # missing, damaged or foreign: dropped with the rows past it
                p._next = len(p._rows)
                break
            block = got[0]
            if self._exact is None:
                self._exact = block.layout.needs_exact
            if not self.ram.add(block, persisted=True, root=p.found.seed):  # no room, or RAM let the
                p._next = len(p._rows)  # block before it go since the last call (it stays prefix-closed)
                break
            self.ram.counters.promotions += 1
            p.blocks_taken += 1
            took += 1
        if p.blocks_taken == p.last - p.first and p._tail is not None:  # the tail past the run, if one was stored
            tail = self.ssd.take_tail(chain[p.last - 1], p._tail)
            if tail is not None and self._exact is False and self.ram.add_tail(tail, p.found.seed):
                self.ram.counters.promotions += 1
        if p.blocks_taken:
            self._landed[chain[p.first + p.blocks_taken - 1]] = None
            while len(self._landed) > LANDED_MAX:
                self._landed.popitem(last=False)
        p.finished = True
        return True

    def _reader(self) -> ThreadPoolExecutor:
        with self._reader_lock:
            if self._reader_pool is None:
                self._reader_pool = ThreadPoolExecutor(1, thread_name_prefix="pomona-ssd-reader")
            return self._reader_pool

    def lookup(self, tokens: Sequence[int], salt: str = "") -> Hit | None:
        """`find` and `restore` in one (tests, benchmarks, warm-up tools)."""
        return self.restore(tokens, self.find(tokens, salt), salt)

    # -- offers ---------------------------------------------------------------------------------
    def held(self, tokens: Sequence[int], salt: str = "") -> int:
        """How many leading tokens of `tokens` RAM holds as whole blocks now: an offer of them made
        before anything else runs on this thread may start there (`offer`'s `start`)."""
        toks = np.asarray(tokens, dtype=np.int64)
        k = len(toks) // self.block_size
        return self.ram.reach(self._chain(toks[:k * self.block_size], salt)) * self.block_size if k else 0

    def offer(self, tokens: Sequence[int], cache: list[Any], kind: OfferKind, salt: str = "", start: int = 0) -> None:
        """Keep the blocks of `cache` (covering exactly `tokens[start:]`) that RAM lacks, and where the
        offer ends either its tail (RAM; and for a "finished" offer the SSD, under its last block) or,
        on a block boundary, its exact state. Every block is written to the SSD once (it costs its own
        bytes, never a conversation's): now, or with `cache.ssd_write: idle` once no request runs.

        `start` (a multiple of the block size, at most what `held` says): the caller copied only the
        KV past what RAM holds. Why: a turn of a long conversation otherwise copies its whole history
        on the device twice (at its prompt's end and at its finish) to have the store keep its new
        blocks (a 20k-token turn of a 30B-class model: gigabytes of transient device memory). Blocks
        before `start` that RAM no longer holds cannot be rebuilt from it: nothing past them is kept
        (a chain is held root first), and the offer counts as rejected."""
        toks = np.asarray(tokens, dtype=np.int64)
        n, bs = len(toks), self.block_size
        try:
            if start % bs or not 0 <= start < n:
                raise ValueError(f"an offer starting at token {start} of {n} (blocks of {bs})")
            parts = blk.split(cache, n - start)
            if start and parts.exact:  # an exact layer's state covers every token: it cannot start later
                raise ValueError("an offer with exact layers must cover its tokens from the first")
        except (TypeError, ValueError) as e:
            self.totals.rejected += 1
            log.debug("prefix cache: not storing offer: %s", e)
            return
        exact = parts.layout.needs_exact
        self._exact = exact
        k = n // bs
        chain = self._chain(toks[:k * bs], salt)
        have = self.ram.reach(chain)
        if have * bs < start:  # evicted since `held` said so: the chain has a gap this cache cannot fill
            self.totals.rejected += 1
            return
        quant = None
        if self.quant is not None and n >= self.quant.min_tokens:
            quant = (self.quant.bits, self.quant.group_size)
        self._keep_blocks(blk.cut_blocks(parts, chain, toks, have, k, bs, quant, offset=start), self._seed(salt))
        if k * bs < n:  # the tokens past the last whole block: RAM, and the SSD under a block
            tail = blk.cut_tail(parts, k * bs, chain[k - 1] if k else None, toks, offset=start)
            self.ram.add_tail(tail, self._seed(salt))
            # The SSD gets a finished request's tail (what the next turn, or the same prompt again,
            # continues from), not its prompt's or a checkpoint's, which the finish supersedes at once.
            if k and not exact and kind == "finished":
                self._keep_tail(tail)
        elif exact:  # on a boundary: the exact state there, in both tiers
            state = blk.exact_state(parts, chain[k - 1])
            if state is not None and self.ram.state_at(chain[k - 1]) is None:
                queued = self._write_through(state)
                if not self.ram.add_state(state, persisted=queued) and self.ssd is not None and not queued:
                    self._demote(state, False)

    def _write_through(self, item: Block | ExactState | Tail) -> bool:
        """Hand `item` to the SSD now (write-through); False if not (no SSD, `ssd_write: idle`, or
        no room in the writer's backlog: RAM keeps it as not written, `tick` offers it again)."""
        return self.ssd is not None and self.write_through and self.ssd.offer(item)

    def _keep_blocks(self, new: list[Block], seed: bytes) -> None:
        """An offer's new blocks into RAM and, each once, to the SSD."""
        self.blocks_offered += len(new)
        for b in new:
            queued = self._write_through(b)
            if b.parent is not None:
                self._tails_due.pop(b.parent, None)  # a block under it makes that tail stale
            if not self.ram.add(b, persisted=queued, root=seed) and self.ssd is not None and not queued:
                self._demote(b, False)

    def _keep_tail(self, tail: Tail) -> None:
        """A finished offer's tail to the SSD, now or once the writer has room (`tick`)."""
        if self.ssd is None or self._write_through(tail):
            return
        assert tail.parent is not None
        self._tails_due[tail.parent] = tail
        self._tails_due.move_to_end(tail.parent)
        while len(self._tails_due) > TAILS_DUE_MAX:
            self._tails_due.popitem(last=False)

    def _demote(self, item: Block | ExactState, persisted: bool) -> None:
        if not persisted and self.ssd is not None and self.ssd.offer(item):
            self.ssd.counters.demotions += 1

    def tick(self, drain: bool = False) -> None:
        """Once per engine step on the MLX thread (and with `drain` when idle): hand the SSD writer
        what earlier steps offered, then offer it what its backlog had no room for before.

        Why the second part: the backlog is bounded (`cache.write_queue` rows, 1 GiB) so that host
        copies waiting for the disk never pile up, and one long prompt has more blocks than that
        (15,000 tokens: 234 blocks of 64). Those RAM keeps as not written; without this they reached
        the disk only when RAM evicted them, and a restart lost them: the SSD hit then stopped at
        the first missing block (4,096 of 15,000 tokens on the H200). Oldest first, so a chain is
        written root to leaf, as many a step as the writer has room for. With `cache.ssd_write:
        idle` this catching up is all the writing there is, and only with `drain` (no request runs)."""
        if self.ssd is None:
            return
        if drain:  # idle: what is offered now is handed over at once
            self._catch_up()
        self.ssd.tick(drain)
        if not drain and self.write_through:  # offered now, handed over a step later (computed by then)
            self._catch_up()

    def _catch_up(self) -> None:
        ssd = self.ssd
        assert ssd is not None
        if not ssd.has_room():
            return
        for item in self.ram.unpersisted(limit=ssd.queue_items):
            if not ssd.offer(item, retry=True):
                return
            self.ram.persisted(item)
        while self._tails_due:
            parent, tail = self._tails_due.popitem(last=False)
            if not ssd.offer(tail, retry=True):
                self._tails_due[parent] = tail
                self._tails_due.move_to_end(parent, last=False)
                return

    def unwritten(self) -> int:
        """Blocks (and finished tails) RAM holds that the SSD's writer has not taken yet; it takes
        them as it has room (`tick`). 0 without an SSD or while its writes are off."""
        if self.ssd is None or not self.ssd.writes_enabled:
            return 0
        return self.ram.unwritten + len(self._tails_due)

    # -- the rest of the protocol ----------------------------------------------------------------
    def held_prefixes(self, limit: int = 256) -> list[np.ndarray]:
        """Token ids of the most recently used chains in RAM (cache-affinity routing reports them).
        SSD rows are not listed: enumerating the disk index is slow, and an SSD hit is promoted to
        RAM, so what is in use shows up here after its first hit."""
        return self.ram.recent_chains(limit)

    def set_ram_budget(self, budget_bytes: int) -> None:
        """Shrink or grow the RAM tier at run time (one memory account with running KV state):
        blocks over the new budget are evicted leaf first and demoted to the SSD."""
        self.ram.resize(max(0, budget_bytes))

    def clear(self, tier: Literal["ram", "ssd", "all"] = "all") -> None:
        """Drop cached state (admin endpoint). Clearing RAM does not demote what it drops."""
        if tier in ("ram", "all"):
            self.ram.clear()
        if tier in ("ssd", "all") and self.ssd is not None:
            self.ssd.clear()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "lookups": self.totals.queries,
            "lookup_tokens": self.totals.query_tokens,
            "hits": self.totals.hits,
            "hit_tokens": self.totals.hit_tokens,
            "rejected_offers": self.totals.rejected,
            "hits_below_min_restore": self.too_short,
            "block_size": self.block_size,
            "blocks_offered": self.blocks_offered,
            "ram": self.ram.counters.as_dict(entries=len(self.ram), blocks=len(self.ram), states=self.ram.states,
                                             bytes=self.ram.nbytes, budget_bytes=self.ram.budget),
        }
        if self.ssd is not None:
            out["ssd"] = {**self.ssd.stats(), "unwritten": self.unwritten()}  # RAM's, not on disk yet
        else:
            out["ssd"] = {"enabled": False, "error": self.ssd_error}
        return out

    def flush(self) -> None:
        """Wait until what was handed to the SSD writer is on disk (any thread; the MLX thread's
        `tick(drain=True)` hands over the rest first)."""
        if self.ssd is not None:
            self.ssd.flush()

    def close(self, budget_s: float = CLOSE_WRITE_S) -> None:
        """Write what only RAM holds to the SSD (for up to `budget_s`: a shutdown must end before
        whoever stops the process gives up waiting), flush, and stop the writer (and the reader)."""
        if self._reader_pool is not None:
            self._reader_pool.shutdown(wait=True, cancel_futures=True)
        if self.ssd is None:
            return
        # Until nothing is left, the budget is spent, or twice no progress (the writer stopped).
        stalled, deadline = 0, time.monotonic() + budget_s
        while self.unwritten() and stalled < 2 and time.monotonic() < deadline:
            before = self.unwritten()
            self.tick(drain=True)
            self.ssd.flush()
            stalled = stalled + 1 if self.unwritten() >= before else 0
        if self.unwritten():
            log.warning("prefix cache: %d blocks held in RAM only were not written to the SSD at shutdown "
                        "(the writer stopped, or %.0f s ran out)", self.unwritten(), budget_s)
        self.ssd.close()
