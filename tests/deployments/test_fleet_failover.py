"""The failover rules of `retry_before_first` (deployments/failover.py), without Ray Serve.

A replica's death reaches the ingress as a 503 ApiError raised `from` Ray's RayActorError
(HandleBackend); the streams here are real async generators that fail the same way.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import pytest
from ray.exceptions import RayActorError

from api.core.errors import ApiError, server_error, unavailable
from deployments.failover import ATTEMPTS, replica_went_away, retry_before_first


def went_away() -> ApiError:
    try:
        raise RayActorError()
    except RayActorError as cause:
        try:
            raise unavailable("The model server replica went away; retry the request.") from cause
        except ApiError as err:
            return err


class Replicas:
    """Attempt i streams `plans[i]`: items, then (if the plan ends with one) an exception. Records
    which attempts started and which streams were closed."""

    def __init__(self, *plans: list) -> None:
        self.plans = plans
        self.started: list[int] = []
        self.closed: list[int] = []

    def start(self, attempt: int) -> AsyncIterator[str]:
        self.started.append(attempt)
        return self._stream(attempt)

    async def _stream(self, attempt: int) -> AsyncIterator[str]:
        try:
            for item in self.plans[attempt]:
                await asyncio.sleep(0)
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.closed.append(attempt)


async def drain(stream: AsyncIterator[str]) -> list[str]:
    return [item async for item in stream]


def test_death_before_the_first_item_is_retried_on_another_attempt():
    replicas = Replicas([went_away()], ["a", "b"])
    assert asyncio.run(drain(retry_before_first(replicas.start))) == ["a", "b"]
    assert replicas.started == [0, 1]  # the attempt number reaches the caller (a fresh request id)
    assert replicas.closed == [0, 1]  # the failed stream is closed too (its replica call cancelled)


def test_a_healthy_stream_is_not_restarted():
    replicas = Replicas(["a", "b", "c"])
    assert asyncio.run(drain(retry_before_first(replicas.start))) == ["a", "b", "c"]
    assert replicas.started == [0]


def test_death_after_the_first_item_is_raised_not_retried():
    err = went_away()
    replicas = Replicas(["a", err], ["never"])
    seen: list[str] = []

    async def main() -> None:
        async for item in retry_before_first(replicas.start):
            seen.append(item)

    with pytest.raises(ApiError) as caught:
        asyncio.run(main())
    assert caught.value is err and seen == ["a"]
    assert replicas.started == [0]


def test_errors_that_are_not_a_replica_going_away_are_raised_at_once():
    for err in (server_error("engine failed"), unavailable("not ready"), RuntimeError("bug")):
        replicas = Replicas([err], ["never"])
        with pytest.raises(type(err)) as caught:
            asyncio.run(drain(retry_before_first(replicas.start)))
        assert caught.value is err
        assert replicas.started == [0]


def test_gives_up_after_the_attempts_with_the_last_error():
    errors = [went_away() for _ in range(ATTEMPTS + 1)]
    replicas = Replicas(*[[e] for e in errors])
    with pytest.raises(ApiError) as caught:
        asyncio.run(drain(retry_before_first(replicas.start)))
    assert replicas.started == list(range(ATTEMPTS))
    assert caught.value is errors[ATTEMPTS - 1]
    assert replicas.closed == list(range(ATTEMPTS))


def test_attempts_is_a_bound():
    replicas = Replicas([went_away()], [went_away()], ["a"])
    assert asyncio.run(drain(retry_before_first(replicas.start, attempts=3))) == ["a"]
    replicas = Replicas([went_away()], ["a"])
    with pytest.raises(ApiError):
        asyncio.run(drain(retry_before_first(replicas.start, attempts=1)))
    assert replicas.started == [0]


def test_an_empty_stream_ends_without_a_retry():
    replicas = Replicas([], ["never"])
    assert asyncio.run(drain(retry_before_first(replicas.start))) == []
    assert replicas.started == [0] and replicas.closed == [0]


def test_a_consumer_that_leaves_closes_the_replica_stream():
    replicas = Replicas([went_away()], ["a", "b", "c"])

    async def main() -> None:
        stream = retry_before_first(replicas.start)
        assert await stream.__anext__() == "a"
        await stream.aclose()  # the client disconnected: the replica's generator must be closed now,
        assert replicas.closed == [0, 1]  # not when the event loop ends (the replica would keep generating)

    asyncio.run(main())


def test_replica_went_away_only_for_ray_actor_deaths():
    assert replica_went_away(went_away())
    assert not replica_went_away(unavailable("no replica is ready"))  # no Ray cause
    assert not replica_went_away(RayActorError())  # not mapped by the HandleBackend: a bug, not failover
