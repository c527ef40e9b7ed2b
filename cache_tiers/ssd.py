"""SSD tier: blocks and exact states by chain digest in a diskcache directory, written behind.

Layout. Block k of a chain is the row `block_key(chain[k-1])`; an exact state ending there is
`state_key(chain[k-1])`; the latest finished offer's KV tail past it (fewer than a block of tokens,
models without exact layers) `tail_key(chain[k-1])`, deleted when a block is written under it.
Blocks and states are content-addressed: written once whoever offers them (two replicas sharing a
directory included: the second finds the row there and skips the write), so a conversation's next
turn writes its new blocks only, and the directory's bytes are the distinct tokens it holds.

Probe. Block presence along a prompt's chain is (up to independent LRU eviction) monotone: a
block is offered only with every block before it. The longest stored run is found by binary
search with `contains` (no value read, no LRU write): ~log2(len/block_size) + 1 SQLite lookups.
A gap left by eviction can only make a load stop early, never serve wrong state: the load reads
the blocks in order, checks each one's tokens and parent against the prompt, and stops at the
first block that is missing or damaged (the prefix before it is still served). Exact states are
asked for from the longest run down (at most `EXACT_PROBES` lookups).

Threads. `offer`, `tick`, `probe`, `load`, `clear` run on the engine's MLX thread. An offer only
names the new rows' arrays and starts them (`codec.prepare_*`); `tick`, once per engine step,
hands the rows offered before the previous step to the writer as numpy views (their arrays are
computed by then: no wait), so no offer makes a step wait for the device or the disk. The writer
thread serializes (`codec.encode`) and calls `Storage`; it never calls MLX.

Host copies (`host_copies`, MLX's CUDA backend). There a host read moves an array's buffer into
managed memory for good, which a later GPU read or write pays for (codec.prepare_block says how
much); so the writer reads private copies, and the MLX thread keeps each copy until its row is
written, then frees the written ones together and empties MLX's buffer cache at once
(`_release`), so that no buffer a host read moved is handed to the engine's next arrays. That is
done when RELEASE_BYTES of copies are written, and whenever the engine is idle. A Mac's unified
memory (and the CPU) has nothing to move: there the writer reads the blocks' own arrays.
`host_copies="staged"` adds a copy of each device copy made by MLX's CPU stream, which is what the
writer reads: the device-to-host transfer then runs in MLX's CPU worker, not in `tick`'s
`codec.to_host` on the MLX thread (an A/B for CUDA; codec.prepare_block).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from . import codec
from .blocks import Block, ExactState, Tail
from .keys import block_key, state_key, tail_key
from .stats import TierCounters
from .storage import Storage, UnsafeRow, is_disk_full

log = logging.getLogger(__name__)

# State keys asked for below the longest block run, at most: with checkpoints every 1,024 tokens
# and 64-token blocks one lies within 16 blocks; this bounds a probe over a long chain.
EXACT_PROBES = 64
# Written host copies (`host_copies`) are freed together once this many bytes of them are held:
# each release empties MLX's buffer cache, which the next steps fill again, so it is kept rare (at
# ~300 MB/s of new KV, a 1B model's 128 streams on the H200, about once a second).
RELEASE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class _Pending:
    key: str
    prepared: codec.Prepared
    tick: int  # the step it was offered in
    replace: bool  # a tail: the latest offer's replaces the row; blocks and states are written once
    supersedes: str | None  # a block: the tail row under its parent, which it makes stale


@dataclass(frozen=True)
class _Write:
    key: str
    entry: codec.HostEntry
    replace: bool = False
    supersedes: str | None = None
    seq: int = 0  # handed over in this order; the writer's `_done` says how far it got


class SsdTier:
    def __init__(self, storage: Storage, fingerprint: str, block_size: int,
                 queue_items: int = 4096, queue_bytes: int = 2**30, host_copies: bool | str = False) -> None:
        self.storage = storage
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.counters = TierCounters()
        self.writes_enabled = True
        self.bytes_written = 0  # serialized bytes the writer stored (what the disk paid)
        self.stats_errors = 0  # stats() calls that could not size the directory
        self.lost_files = 0  # rows that were there but whose file was gone
        self._stats_failing = False
        self._queue_items = max(1, queue_items)
        self._queue_bytes = queue_bytes
        self._pending_bytes = 0  # offered, not yet written (pending + queued)
        self._lock = threading.Lock()
        self._pending: deque[_Pending] = deque()
        self._tick = 0
        self._queue: queue.Queue[_Write | None] = queue.Queue()
        self.host_copies = host_copies
        self._seq = 0  # the last write handed over
        self._done = 0  # the last write the writer finished (it writes in order)
        self._held: deque[tuple[int, codec.Prepared]] = deque()  # host copies, until written
        self._written = 0  # the leading held copies whose rows are written, and their bytes
        self._written_bytes = 0
        self.releases = 0  # times written host copies were freed (and MLX's buffer cache emptied)
        self._writer = threading.Thread(target=self._write_loop, name="pomona-ssd-writer", daemon=True)
        self._writer.start()

    # ---- MLX thread -------------------------------------------------------------------------

    @property
    def queue_items(self) -> int:
        """The backlog's bound in rows (offered, not yet written)."""
        return self._queue_items

    def has_room(self) -> bool:
        """Whether an offer now could be taken (writes enabled, the backlog below its bounds)."""
        with self._lock:
            backlog = len(self._pending) + self._queue.qsize()
            return self.writes_enabled and backlog < self._queue_items and self._pending_bytes < self._queue_bytes

    def offer(self, item: Block | ExactState | Tail, retry: bool = False) -> bool:
        """Name `item`'s arrays for writing and start them; False if not taken (writes disabled,
        or the backlog is full: the RAM tier then keeps it as not persisted, and the store offers
        it again once the writer has room). `retry`: such a second offer, whose refusal is not
        counted again as a drop.
        A tail (a KV tail under a block) replaces the one stored under that block; a block written
        later under the same parent deletes it (its tokens are then in that block, or the
        conversation went another way)."""
        if not self.writes_enabled:
            return False
        private = self.host_copies
        if isinstance(item, Tail):
            prepared = codec.prepare_tail(item, private)
        elif isinstance(item, Block):
            prepared = codec.prepare_block(item, private)
        else:
            prepared = codec.prepare_state(item, private)
        size = prepared.nbytes
        with self._lock:
            backlog = len(self._pending) + self._queue.qsize()
            if backlog >= self._queue_items or (self._pending_bytes and self._pending_bytes + size > self._queue_bytes):
                if not retry:
                    self.counters.write_drops += 1
                return False
            self._pending_bytes += size
        if isinstance(item, Tail):
            assert item.parent is not None  # prepare_tail refused it otherwise
            pending = _Pending(tail_key(item.parent), prepared, self._tick, True, None)
        elif isinstance(item, Block):
            stale = tail_key(item.parent) if item.parent is not None else None
            pending = _Pending(block_key(item.digest), prepared, self._tick, False, stale)
        else:
            pending = _Pending(state_key(item.digest), prepared, self._tick, False, None)
        self._pending.append(pending)
        return True

    def tick(self, drain: bool = False) -> None:
        """Once per engine step: hand what was offered before this step to the writer (its arrays
        are computed by now); with `drain`, everything (an idle engine, close)."""
        while self._pending and (drain or self._pending[0].tick < self._tick):
            item = self._pending.popleft()
            self._seq += 1
            if self.host_copies:
                self._held.append((self._seq, item.prepared))
            self._queue.put(_Write(item.key, codec.to_host(item.prepared), item.replace, item.supersedes, self._seq))
        self._tick += 1
        if self._held:
            self._release(everything=drain)

    def _release(self, everything: bool) -> None:
        """Free the host copies whose rows are written, once RELEASE_BYTES of them wait (or with
        `everything`, any), and empty MLX's buffer cache right after: their buffers (moved to
        managed memory by the host read) must not be handed to the engine's next arrays."""
        done = self._done
        # The leading copies known written are counted once (a step looks at the new ones only).
        while self._written < len(self._held) and self._held[self._written][0] <= done:
            self._written_bytes += self._held[self._written][1].nbytes
            self._written += 1
        if not self._written or (not everything and self._written_bytes < RELEASE_BYTES):
            return
        for _ in range(self._written):
            self._held.popleft()
        self._written, self._written_bytes = 0, 0
        mx.clear_cache()
        self.releases += 1

    @property
    def held_copies(self) -> int:
        """Host copies kept until their rows are written and released (`host_copies`)."""
        return len(self._held)

    def probe(self, chain: Sequence[bytes], lo: int, exact: bool | None, floor: int) -> tuple[int, int]:
        """(how far a run of blocks reaches along the chain when the SSD continues one held up to
        block `lo - 1` (RAM's): `lo - 1` if it does not; the deepest stored exact state above
        block `floor` within that reach, 0 if none). `exact` False: the model has no exact
        layers, skip that search; None: not known yet. Reads markers only, copies nothing."""
        try:
            run = max(lo - 1, self._longest_run(chain, max(1, lo)))
            state = 0
            if exact is not False:
                for k in range(run, max(floor, run - EXACT_PROBES), -1):
                    if self.storage.contains(state_key(chain[k - 1])):
                        state = k
                        break
            return run, state
        except Exception as e:  # a failing disk must never fail a request
            self.counters.read_errors += 1
            log.warning("prefix cache: SSD read failed: %s", e)
            return 0, 0

    def _longest_run(self, chain: Sequence[bytes], lo: int) -> int:
        best, hi = 0, len(chain)
        if lo > hi or not self.storage.contains(block_key(chain[lo - 1])):
            return 0
        best, lo = lo, lo + 1
        while lo <= hi:
            mid = (lo + hi) // 2
            if self.storage.contains(block_key(chain[mid - 1])):
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best

    def load_blocks(self, chain: Sequence[bytes], tokens: np.ndarray, first: int, last: int) -> list[Block]:
        """Blocks `first` .. `last - 1` of the chain, read in order; stops at the first one that
        is missing, damaged or not this prompt's (the ones before it are still good)."""
        return self.take_blocks(chain, tokens, first, last, self.read_blocks(chain, first, last))

    def read_blocks(self, chain: Sequence[bytes], first: int, last: int) -> list[Any]:
        """The rows of blocks `first` .. `last - 1`, read and parsed in order up to the first that
        is missing (None) or fails (its exception, last in the list). Calls no MLX and changes
        nothing (the rows, the counters): a reader thread may run it while the MLX thread steps;
        `take_blocks` then does the rest there."""
        out: list[Any] = []
        for j in range(first, last):
            try:
                data = self.storage.get(block_key(chain[j]))
                if data is None:
                    out.append(None)
                    break
                out.append(codec.parse_block(data, self.fingerprint, chain[j], self.block_size))
            except Exception as e:  # judged by `take_blocks`, on the MLX thread
                out.append(e)
                break
        return out

    def read_tail(self, parent: bytes) -> Any:
        """The tail stored under block `parent`, read and parsed (None: there is none; an exception
        if it fails); like `read_blocks`, no MLX and nothing changed: any thread."""
        try:
            data = self.storage.get(tail_key(parent))
            return None if data is None else codec.parse_tail(data, self.fingerprint, parent, self.block_size)
        except Exception as e:  # judged by `take_tail`, on the MLX thread
            return e

    def take_tail(self, parent: bytes, row: Any) -> Tail | None:
        """MLX thread: the tail `read_tail(parent)` read, made MLX arrays; a damaged row is deleted
        and counted (the blocks before it still serve), a failed read counted."""
        if row is None:
            return None
        key = tail_key(parent)
        if isinstance(row, (codec.CorruptEntry, UnsafeRow)):
            self._corrupt(key, row)
            return None
        if isinstance(row, Exception):
            self.counters.read_errors += 1
            log.warning("prefix cache: SSD read failed: %s", row)
            return None
        try:
            return codec.to_tail(row)
        except Exception as e:
            self._corrupt(key, codec.CorruptEntry(f"{type(e).__name__}: {e}"))
            return None

    def take_blocks(self, chain: Sequence[bytes], tokens: np.ndarray, first: int, last: int,
                    read: list[Any]) -> list[Block]:
        """MLX thread: the blocks `read_blocks(chain, first, last)` read, checked against this
        prompt's chain and tokens and made MLX arrays; a missing, damaged or foreign row is dropped
        with the chain's rows past it (up to `last`), and the blocks before it are kept."""
        out: list[Block] = []
        bs = self.block_size
        for j, row in enumerate(read, start=first):
            key = block_key(chain[j])
            if row is None:
                self._drop_unreadable(key, chain[j + 1:last])
                break
            if isinstance(row, (codec.CorruptEntry, UnsafeRow)):
                self._corrupt(key, row, chain[j + 1:last])
                break
            if isinstance(row, Exception):  # a failing disk must never fail a request
                self.counters.read_errors += 1
                log.warning("prefix cache: SSD read failed: %s", row)
                break
            if row.parent != (chain[j - 1] if j else None) or not np.array_equal(row.tokens,
                                                                              tokens[j * bs:(j + 1) * bs]):
                self._corrupt(key, codec.CorruptEntry("a block of another prefix under this key"), chain[j + 1:last])
                break
            try:
                out.append(codec.to_block(row))
            except Exception as e:
                self._corrupt(key, codec.CorruptEntry(f"{type(e).__name__}: {e}"), chain[j + 1:last])
                break
        return out

    def load_state(self, digest: bytes) -> ExactState | None:
        key = state_key(digest)
        try:
            data = self.storage.get(key)
            if data is None:
                self._drop_unreadable(key)
                return None
            return codec.decode_state(data, self.fingerprint, digest)
        except (codec.CorruptEntry, UnsafeRow) as e:
            self._corrupt(key, e)
        except Exception as e:
            self.counters.read_errors += 1
            log.warning("prefix cache: SSD read failed: %s", e)
        return None

    def _corrupt(self, key: str, e: Exception, after: Sequence[bytes] = ()) -> None:
        """Delete a damaged row, counted once. The chain's rows past a damaged block go too: they
        cannot be reached until it is written again, and the recompute that writes it offers them
        again as well (a writer skips rows that exist, so damaged ones left there would stay)."""
        self.counters.corrupt += 1
        log.warning("prefix cache: deleting corrupt SSD row %s (and the %d blocks after it): %s", key, len(after), e)
        try:
            self.storage.delete(key)
            for digest in after:
                self.storage.delete(block_key(digest))
                self.storage.delete(state_key(digest))
        except Exception as exc:
            log.warning("prefix cache: cannot delete %s: %s", key, exc)

    def _drop_unreadable(self, key: str, after: Sequence[bytes] = ()) -> None:
        """A row that reads as nothing: evicted since the probe (normal), or a row whose file is
        gone (the directory was deleted or its files removed): a fault, counted; the chain's rows
        past it go too (their files are likely gone as well, and a writer skips rows that exist,
        so the recompute could not write them again)."""
        if self.storage.contains(key):
            self.lost_files += 1
            log.warning("prefix cache: the file of SSD row %s is missing (directory deleted?); dropping it "
                        "and the %d blocks after it", key, len(after))
            self.storage.delete(key)
            for digest in after:
                self.storage.delete(block_key(digest))
                self.storage.delete(state_key(digest))

    def flush(self) -> None:
        """Wait until what has been handed to the writer is on disk (any thread). Offers not yet
        handed over (the step after theirs does it, or the engine when idle) are not waited for."""
        self._queue.join()

    def clear(self) -> None:
        """Empty the directory; a disk that was full has room again, so writes resume."""
        self.tick(drain=True)
        self.flush()
        self.storage.clear()
        self.writes_enabled = True

    def close(self) -> None:
        self.tick(drain=True)
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
            self.storage.close()
        if self._held:
            self._release(everything=True)

    @property
    def backlog(self) -> int:
        return len(self._pending) + self._queue.qsize()

    # ---- writer thread ----------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            seq = item.seq
            try:
                if self.writes_enabled:
                    self._write(item)
            finally:
                with self._lock:
                    self._pending_bytes -= item.entry.nbytes
                # The entry's numpy views go here, before `_done` says so: the MLX thread frees the
                # arrays under them (host copies) only after, on its own thread (`_release`).
                del item
                self._done = seq
                self._queue.task_done()

    def _write(self, item: _Write) -> None:
        try:
            if item.replace or not self.storage.contains(item.key):
                data = codec.encode(item.entry, self.fingerprint)
                self.storage.set(item.key, data)
                self.counters.writes += 1
                self.bytes_written += len(data)
                if item.supersedes is not None:  # the tail this block continues (or branches from)
                    self.storage.delete(item.supersedes)
        except Exception as e:
            if is_disk_full(e):
                self.writes_enabled = False
                log.warning("prefix cache: SSD full, SSD writes disabled (reads continue): %s", e)
            else:
                log.warning("prefix cache: SSD write failed: %s", e)
            self.counters.write_errors += 1

    def stats(self) -> dict[str, object]:
        """Counters plus what the directory holds: `keys` counts blocks, exact states and tails.

        A directory that cannot be counted (deleted, unreadable) leaves `keys`/`bytes` out rather
        than reporting a made-up number; `stats_errors` counts those failures (logged once per run
        of failures, not on every scrape)."""
        sizes: dict[str, int] = {}
        try:
            sizes = {"keys": self.storage.count(), "bytes": self.storage.volume()}
        except Exception as e:  # stats must render whatever the disk does
            self.stats_errors += 1
            if not self._stats_failing:
                log.warning("prefix cache: cannot read the SSD directory's size (%s: %s); "
                            "keys/bytes are left out of the stats until it can be read", type(e).__name__, e)
            self._stats_failing = True
        else:
            if self._stats_failing:
                log.info("prefix cache: the SSD directory's size can be read again")
            self._stats_failing = False
        return self.counters.as_dict(enabled=True, writes_enabled=self.writes_enabled, queued=self.backlog,
                                     queued_bytes=self._pending_bytes, bytes_written=self.bytes_written,
                                     lost_files=self.lost_files, stats_errors=self.stats_errors, **sizes)
