"""SSD tier: entries at block boundaries in a diskcache directory, written behind by one thread.

Layout. An entry covering k blocks is stored under `entry_key(chain[k-1])`; alongside, a small
marker `marker_key(chain[j-1]) -> entry key` for every j <= k says "an entry extends through
block j". Entries are written only at block boundaries (a trimmable cache is cut down to the
largest multiple of block_size; a non-trimmable one that is not aligned is not stored).

Exact entries. A non-trimmable entry (a hybrid model's state-space layers, a rotated cache)
serves only prompts that extend all of its k blocks, so "extends through block j" markers would
point prompts that diverge inside it at an entry they cannot use, hiding shorter entries that
would serve. Such an entry gets `exact_marker_key(chain[j-1])` markers instead, saying "an exact
entry lies at or past block j"; they are monotone too. A probe binary-searches them for the last
block J any exact entry reaches along the prompt, then asks for entry keys from J down (at most
`EXACT_PROBES`): the first that exists ends on the prompt's own chain and serves it.

Probe. Marker presence is (up to independent LRU eviction) monotone along a prompt's chain: if a
marker exists at block j, one exists at every block before it. So the longest stored prefix is
found by binary search over chain positions with `contains` (no value read, no LRU write):
~log2(len/block_size) + 1 SQLite lookups, e.g. 6 for a 2,000-token prompt with 64-token blocks,
against up to 31 when probing from the longest down. A gap left by eviction can only make the
answer shorter, never wrong. The entry a marker names may extend past the prompt and is trimmed,
so a stored conversation serves every prompt that shares a block prefix with it. Stored token
ids are compared with the prompt before use: a hash collision or stale marker is a miss.

Threads. `find`, `offer`, `clear` run on the engine's MLX thread; the writer thread only
serializes numpy views (`codec.encode`) and calls `Storage`; it never calls MLX.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import codec
from .keys import block_chain, chain_seed, entry_key, exact_marker_key, marker_key
from .snapshot import Snapshot, common_prefix, truncate, usable_length
from .stats import TierCounters
from .storage import Storage, UnsafeRow, is_disk_full

log = logging.getLogger(__name__)

# Entry keys asked for below the last exact marker, at most: with checkpoints every 1,024 tokens
# and 64-token blocks one lies within 16 blocks; this bounds a probe over stale markers.
EXACT_PROBES = 64


@dataclass(frozen=True)
class SsdMatch:
    snap: Snapshot  # the whole stored entry (promoted to RAM as is)
    num_tokens: int  # prompt tokens it can serve


@dataclass(frozen=True)
class _Write:
    key: str
    markers: tuple[str, ...]
    entry: codec.HostEntry


class SsdTier:
    def __init__(self, storage: Storage, fingerprint: str, block_size: int,
                 queue_items: int = 64, queue_bytes: int = 2**30) -> None:
        self.storage = storage
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.seed = chain_seed(fingerprint)
        self.counters = TierCounters()
        self.writes_enabled = True
        self.stats_errors = 0  # stats() calls that could not size the directory
        self.lost_files = 0  # entries whose row was there but whose file was gone
        self._stats_failing = False
        self._queue_bytes = queue_bytes
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Write | None] = queue.Queue(maxsize=max(1, queue_items))
        self._writer = threading.Thread(target=self._write_loop, name="pomona-ssd-writer", daemon=True)
        self._writer.start()

    # ---- MLX thread -------------------------------------------------------------------------

    def offer(self, snap: Snapshot, block: bool = False) -> bool:
        """Queue `snap` (cut to a block boundary) for writing; False if not queued. Only `close`
        blocks: the engine's thread must never wait for the disk."""
        if not self.writes_enabled:
            return False
        k = snap.num_tokens // self.block_size
        if k == 0 or (k * self.block_size != snap.num_tokens and not snap.trimmable):
            self.counters.rejected += 1
            return False
        snap = truncate(snap, k * self.block_size)
        chain = block_chain(snap.tokens, self.block_size, self.seed)
        marker = marker_key if snap.trimmable else exact_marker_key
        item = _Write(entry_key(chain[-1]), tuple(marker(d) for d in chain), codec.to_host(snap))
        size = item.entry.nbytes
        with self._lock:
            if not block and self._pending_bytes and self._pending_bytes + size > self._queue_bytes:
                self.counters.write_drops += 1
                return False
            self._pending_bytes += size
        try:
            self._queue.put(item, block=block)
        except queue.Full:
            with self._lock:
                self._pending_bytes -= size
            self.counters.write_drops += 1
            return False
        return True

    def find(self, tokens: np.ndarray, min_blocks: int = 1) -> SsdMatch | None:
        """The stored entry serving the longest prefix of `tokens` from block `min_blocks` up."""
        return self.load(tokens, self.probe(tokens, min_blocks))

    def probe(self, tokens: np.ndarray, min_blocks: int = 1) -> int:
        """How many leading blocks of `tokens` a stored entry extends through (0: none), from
        `min_blocks` up. Reads markers only: the scheduler may ask before deciding to admit."""
        chain = block_chain(tokens, self.block_size, self.seed)
        try:
            lo = max(1, min_blocks)
            cut = self._longest_marker(chain, lo, marker_key)
            return max(cut, self._longest_exact(chain, max(lo, cut + 1), len(tokens)))
        except Exception as e:  # a failing disk must never fail a request
            self.counters.read_errors += 1
            log.warning("prefix cache: SSD read failed: %s", e)
            return 0

    def load(self, tokens: np.ndarray, blocks: int) -> SsdMatch | None:
        """Read the entry a probe found through `blocks` blocks (None: gone since, or damaged)."""
        if blocks == 0:
            return None
        chain = block_chain(tokens[:blocks * self.block_size], self.block_size, self.seed)
        try:
            return self._load(chain[blocks - 1], blocks, tokens)
        except Exception as e:  # a failing disk must never fail a request
            self.counters.read_errors += 1
            log.warning("prefix cache: SSD read failed: %s", e)
            return None

    def _longest_marker(self, chain: list[bytes], lo: int, key: Callable[[bytes], str],
                        hi: int | None = None) -> int:
        best, hi = 0, len(chain) if hi is None else hi
        while lo <= hi:
            mid = (lo + hi) // 2
            if self.storage.contains(key(chain[mid - 1])):
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best

    def _longest_exact(self, chain: list[bytes], lo: int, prompt_len: int) -> int:
        """The most blocks an exact entry on this chain covers, from `lo` up, leaving at least one
        prompt token to feed (0: none). One lookup when there are no exact entries at all."""
        hi = min(len(chain), (prompt_len - 1) // self.block_size)
        if lo > hi or not self.storage.contains(exact_marker_key(chain[lo - 1])):
            return 0
        reach = self._longest_marker(chain, lo, exact_marker_key, hi)
        for k in range(reach, max(lo, reach - EXACT_PROBES + 1) - 1, -1):
            if self.storage.contains(entry_key(chain[k - 1])):
                return k
        return 0

    def _load(self, digest: bytes, blocks: int, tokens: np.ndarray) -> SsdMatch | None:
        mkey: str | None = marker_key(digest)
        bad = mkey  # the row to delete if what is read turns out damaged
        try:
            ekey = _named_entry(self.storage.get(mkey), len(digest))
            if ekey is None:  # no entry to cut here: an exact entry ends here, or none does any more
                mkey, ekey = None, entry_key(digest)
            bad = ekey
            data = self.storage.get(ekey)
            if data is None:
                self._drop_unreadable(mkey, ekey)
                return None
            entry = codec.decode(data, self.fingerprint)
        except (codec.CorruptEntry, UnsafeRow) as e:
            self.counters.corrupt += 1
            log.warning("prefix cache: deleting corrupt SSD row %s: %s", bad, e)
            self.storage.delete(bad)
            return None
        common = common_prefix(entry.tokens, tokens)
        if common < blocks * self.block_size:  # collision or stale marker: never serve
            self.storage.delete(mkey or ekey)
            return None
        snap = codec.from_host(entry)
        usable = usable_length(snap, common, len(tokens))
        return SsdMatch(snap, usable) if usable > 0 else None

    def _drop_unreadable(self, mkey: str | None, ekey: str) -> None:
        """An entry that reads as nothing: evicted (a normal, stale marker; an exact entry has no
        marker of its own), or a row whose file is gone (the directory was deleted or its files
        removed): a fault, counted."""
        if self.storage.contains(ekey):
            self.lost_files += 1
            log.warning("prefix cache: the file of SSD entry %s is missing (directory deleted?); "
                        "dropping the entry", ekey)
            self.storage.delete(ekey)
        if mkey is not None:
            self.storage.delete(mkey)

    def flush(self) -> None:
        self._queue.join()

    def clear(self) -> None:
        """Empty the directory; a disk that was full has room again, so writes resume."""
        self.flush()
        self.storage.clear()
        self.writes_enabled = True

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
            self.storage.close()

    # ---- writer thread ----------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self.writes_enabled:
                    self._write(item)
            finally:
                if item is not None:
                    with self._lock:
                        self._pending_bytes -= item.entry.nbytes
                self._queue.task_done()

    def _write(self, item: _Write) -> None:
        try:
            if not self.storage.contains(item.key):
                self.storage.set(item.key, codec.encode(item.entry, self.fingerprint))
                self.counters.writes += 1
            value = item.key.encode()
            for m in item.markers:
                self.storage.set(m, value)
        except Exception as e:
            if is_disk_full(e):
                self.writes_enabled = False
                log.warning("prefix cache: SSD full, SSD writes disabled (reads continue): %s", e)
            else:
                log.warning("prefix cache: SSD write failed: %s", e)
            self.counters.write_errors += 1

    def stats(self) -> dict[str, object]:
        """Counters plus what the directory holds: `keys` counts entries and their block markers.

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
        return self.counters.as_dict(enabled=True, writes_enabled=self.writes_enabled, queued=self._queue.qsize(),
                                     queued_bytes=self._pending_bytes,
                                     lost_files=self.lost_files, stats_errors=self.stats_errors, **sizes)


def _named_entry(marker: bytes | None, digest_size: int) -> str | None:
    """The entry key a marker's value names; a value that is not an entry key is a damaged row."""
    if marker is None:
        return None
    text = marker.decode("ascii", "replace")
    hexpart = text[len(entry_key(b"")):]
    if len(hexpart) != 2 * digest_size or hexpart.strip("0123456789abcdef") or entry_key(bytes.fromhex(hexpart)) != text:
        raise codec.CorruptEntry(f"a block marker names {text[:80]!r}, not an entry key")
    return text
