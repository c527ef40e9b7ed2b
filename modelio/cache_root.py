"""Where Pomona keeps what it builds on a host ($POMONA_CACHE_DIR), and the file lock that makes the
processes of one host build or download a thing once: the others wait, then find it there.

Its own module because both model I/O paths need it, the default model's conversion
(modelio/models.py) and hub downloads (modelio/hub.py), and models.py calls into hub.py: here
neither imports the other for it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator


def cache_dir() -> Path:
    """Pomona's cache root: $POMONA_CACHE_DIR, else ~/.cache/pomona."""
    env = os.environ.get("POMONA_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pomona"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock; the OS drops it if the holder dies, so a crash never wedges it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
