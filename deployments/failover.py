"""Failover for streams: a replica that dies before the first event is replaced by another one.

Nothing reached the client yet, so sending the request again is invisible to it (the new replica
recomputes the same prompt). After the first event the client has seen tokens that another
replica would not continue exactly, so a failure then ends the stream with an error event
(api/core/streaming.py) instead: never a silent restart, never a hang.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator, Callable, TypeVar

from ray.exceptions import RayActorError

from api.core.errors import ApiError

log = logging.getLogger("pomona.ingress")

T = TypeVar("T")
ATTEMPTS = 2  # the first try plus one retry: a second death in a row means the fleet is in trouble


def replica_went_away(exc: BaseException) -> bool:
    """The HandleBackend maps Ray's actor errors to 503 ApiErrors `from` the Ray error."""
    return isinstance(exc, ApiError) and isinstance(exc.__cause__, RayActorError)


async def retry_before_first(start: Callable[[int], AsyncIterator[T]],
                             retryable: Callable[[BaseException], bool] = replica_went_away,
                             attempts: int = ATTEMPTS,
                             on_retry: Callable[[], None] | None = None) -> AsyncIterator[T]:
    """Items of `start(attempt)`; restarted (attempt 1, 2, ...) while it fails before its first item.
    `on_retry` is called before each restart (the ingress counts failovers in /metrics)."""
    for attempt in range(attempts):
        stream = start(attempt)
        try:
            try:
                first = await stream.__anext__()
            except StopAsyncIteration:
                return
            except Exception as exc:
                if not retryable(exc) or attempt + 1 >= attempts:
                    raise
                log.warning("model server replica went away before the first event (%s); retrying on another",
                            exc.__cause__ or exc)
                if on_retry is not None:
                    on_retry()
                continue
            yield first
            async for item in stream:
                yield item
            return
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
