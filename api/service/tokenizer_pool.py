"""The one tokenizer / chat-template thread of an ingress model, with a bounded queue in front.

One thread for all tokenizer work: HF fast tokenizers may refuse concurrent use ("Already
borrowed"), and tokenizing a long prompt must not stall the event loop. One thread is also one
queue, so a burst of large bodies (`count_tokens` of 4 MiB each) delays every request's first
token behind it: past `max_queue` requests waiting or running there, a request is refused with 429
and `Retry-After` (as the engine's own queue does) instead of waiting without bound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable

from api.core.errors import overloaded

RETRY_AFTER_S = 1.0


class TokenizerPool:
    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        # Request jobs submitted and not yet finished. One whose caller left stops counting though its
        # job may still run: the bound is on requests waiting, and such a job holds no request.
        self.queued = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pomona-tokenizer")

    async def run(self, fn: Callable[[], Any], bounded: bool = True) -> Any:
        """`fn()` on the tokenizer thread. `bounded` (request work): refused with 429 when the queue
        is full; the server's own work (loading the tokenizer) is never refused."""
        if bounded and self.queued >= self.max_queue:
            raise overloaded(f"The server's tokenizer is busy ({self.queued} requests waiting to be tokenized); "
                             "retry after a short delay.", RETRY_AFTER_S)
        if bounded:
            self.queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        finally:
            if bounded:
                self.queued -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
