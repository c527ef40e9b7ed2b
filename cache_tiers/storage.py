"""Where SSD-tier bytes live, kept apart from how they are serialized (as diskcache's own
`Cache`/`Disk` split does), so tests can inject failures such as a full disk.

`DiskcacheStorage` stores raw bytes only: `RawBytesDisk` refuses to store anything but bytes and
refuses to read back any pickled or text row, so a tampered cache database can never make us
unpickle. diskcache keeps small values (< 32 KiB: our markers) in SQLite and large ones (entries)
as files; both come back as the exact bytes written.
"""

from __future__ import annotations

import errno
import io
import sqlite3
from typing import Protocol

import diskcache
from diskcache.core import MODE_BINARY, MODE_RAW


class Storage(Protocol):
    def get(self, key: str) -> bytes | None: ...
    def set(self, key: str, value: bytes) -> None: ...
    def contains(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...
    def clear(self) -> None: ...
    def volume(self) -> int: ...
    def count(self) -> int: ...
    def close(self) -> None: ...


_MIN_FILE_SIZE = 2**15  # diskcache's default disk_min_file_size


class UnsafeRow(ValueError):
    """A row diskcache would have to unpickle (or decode as text): never read, treated as corrupt."""


class RawBytesDisk(diskcache.Disk):
    """A diskcache Disk that only ever stores and returns raw bytes (never pickle)."""

    def store(self, value, read, key=diskcache.core.UNKNOWN):  # type: ignore[override]
        if type(value) is not bytes and not (read and isinstance(value, io.BytesIO)):
            raise TypeError("RawBytesDisk stores bytes only")
        return super().store(value, read, key=key)

    def fetch(self, mode, filename, value, read):  # type: ignore[override]
        if mode not in (MODE_RAW, MODE_BINARY):
            raise UnsafeRow(f"refusing to decode a row of mode {mode}")
        return super().fetch(mode, filename, value, read)

    def get(self, key, raw):  # type: ignore[override]
        if not raw:
            raise UnsafeRow("refusing to unpickle a key")
        return super().get(key, raw)


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC/EDQUOT from a file write, or SQLite's own "database or disk is full"."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(exc, sqlite3.Error) and "full" in str(exc).lower()


class DiskcacheStorage:
    """diskcache directory with LRU eviction under `size_limit` bytes."""

    def __init__(self, directory: str, size_limit: int) -> None:
        self._cache = diskcache.Cache(
            directory,
            size_limit=size_limit,
            eviction_policy="least-recently-used",
            disk=RawBytesDisk,
            statistics=False,
            timeout=2.0,  # a lookup must not hang on a locked database; errors count as misses
        )

    def get(self, key: str) -> bytes | None:
        value = self._cache.get(key, default=None)
        if value is not None and type(value) is not bytes:
            raise UnsafeRow("non-bytes value")
        return value

    def set(self, key: str, value: bytes) -> None:
        if len(value) < _MIN_FILE_SIZE:  # markers: a SQLite row
            self._cache.set(key, value, retry=True)
        else:  # entries: a file, written in 4 MiB chunks (bytes would be written line by line)
            self._cache.set(key, io.BytesIO(value), read=True, retry=True)

    def contains(self, key: str) -> bool:
        return key in self._cache

    def delete(self, key: str) -> None:
        self._cache.delete(key, retry=True)

    def clear(self) -> None:
        self._cache.clear(retry=True)

    def volume(self) -> int:
        return self._cache.volume()

    def count(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._cache.close()
