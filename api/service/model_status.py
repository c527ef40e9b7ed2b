"""Where each LLM server replica is with its model: downloading (bytes done), loading, ready or failed.

A replica downloads a hub model and loads it inside its constructor, so Serve routes nothing to it
before the engine is ready; but Serve cannot call a replica that is still being constructed, so the
replica posts its phase to a small named Ray actor (the board) and the ingress reads the board for
/health (while no replica is ready) and GET /admin/models. The board is detached: it has to outlive
a replica whose constructor failed, so that /health can still say why. Entries not refreshed for
STALE_S (a replica that died) are dropped when read.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from typing import Any, Callable

log = logging.getLogger("pomona.llm_server")

BOARD_NAME = "pomona_model_status"
BOARD_NAMESPACE = "pomona"
HEARTBEAT_S = 1.0  # while downloading or loading
HEARTBEAT_READY_S = 10.0
STALE_S = 60.0
READ_TIMEOUT_S = 2.0

PHASES = ("downloading", "loading", "ready", "failed", "unloaded")  # unloaded: evicted by multiplexing


class StatusBoard:
    """The named actor's class (wrapped by ray.remote in `board()`): the latest entry of each replica."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Any]] = {}

    def report(self, key: str, entry: dict[str, Any]) -> None:
        self._entries[key] = {**entry, "updated": time.time()}

    def read(self) -> list[dict[str, Any]]:
        now = time.time()
        self._entries = {k: e for k, e in self._entries.items() if now - e["updated"] < STALE_S}
        return sorted(self._entries.values(), key=lambda e: (e["model"], e["host"], e["pid"]))


def board(create: bool) -> Any:
    """The board actor's handle (None when `create` is False and there is none yet)."""
    import ray

    if not create:
        try:
            return ray.get_actor(BOARD_NAME, namespace=BOARD_NAMESPACE)
        except ValueError:
            return None
    return ray.remote(StatusBoard).options(name=BOARD_NAME, namespace=BOARD_NAMESPACE, get_if_exists=True,
                                           lifetime="detached", num_cpus=0).remote()


async def read_board() -> list[dict[str, Any]]:
    """Every fresh entry on the board ([] when there is no board or it does not answer)."""
    handle = board(create=False)
    if handle is None:
        return []
    try:
        return await asyncio.wait_for(handle.read.remote(), READ_TIMEOUT_S)
    except Exception:  # the board is an aid to the operator: its absence must not fail /health
        log.debug("model status board did not answer", exc_info=True)
        return []


class ModelStatus:
    """One replica's phase; `publish(key, entry)` posts it (None: keep it local, as in tests without Ray)."""

    def __init__(self, served_name: str, source: str,
                 publish: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self._lock = threading.Lock()  # download progress arrives on huggingface_hub's worker threads
        self._entry: dict[str, Any] = {"model": served_name, "source": source, "phase": "loading",
                                       "bytes_done": 0, "bytes_total": None, "error": None,
                                       "host": socket.gethostname(), "pid": os.getpid()}
        self._key = f"{served_name}|{self._entry['host']}|{self._entry['pid']}"
        self._publish = publish
        self._heartbeat: asyncio.Task | None = None

    @classmethod
    def on_board(cls, served_name: str, source: str) -> "ModelStatus":
        handle = board(create=True)
        return cls(served_name, source, lambda key, entry: handle.report.remote(key, entry))

    def entry(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._entry)

    def set(self, **values: Any) -> None:
        with self._lock:
            self._entry.update(values)
        self.post()

    def progress(self, done: int, total: int | None) -> None:
        with self._lock:  # posted by the heartbeat, not per chunk
            self._entry.update(phase="downloading", bytes_done=done, bytes_total=total)

    def post(self) -> None:
        if self._publish is None:
            return
        try:
            self._publish(self._key, self.entry())
        except Exception:  # e.g. the board was killed: the next post tries again
            log.debug("could not post the model status", exc_info=True)

    async def prepare(self, model: str) -> None:
        """Download a hub model not yet cached, on a worker thread (never the MLX thread)."""
        from modelio.models import is_hub_id, resolve_model

        self._heartbeat = self._heartbeat or asyncio.create_task(self._beat())
        if not is_hub_id(model):
            return
        try:
            await asyncio.to_thread(resolve_model, model, self._report(model))
        except Exception as exc:
            self.set(phase="failed", error=str(exc))
            raise
        self.set(phase="loading")

    def _report(self, model: str) -> Callable[[int, int | None], None]:
        from modelio.hub import HubRef, log_progress

        to_log = log_progress(HubRef.parse(model))

        def report(done: int, total: int | None) -> None:
            self.progress(done, total)
            to_log(done, total)
        return report

    async def _beat(self) -> None:
        while True:
            self.post()
            await asyncio.sleep(HEARTBEAT_READY_S if self.entry()["phase"] == "ready" else HEARTBEAT_S)

    def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()


def describe(entries: list[dict[str, Any]]) -> str:
    """A one-line summary for a 503 message, e.g. 'tiny: downloading 1.2/4.0 MB (30%)'."""
    parts = []
    for e in entries:
        if e["phase"] == "downloading":
            total = e.get("bytes_total")
            share = f" ({100 * e['bytes_done'] / total:.0f}%)" if total else ""
            parts.append(f"{e['model']}: downloading {e['bytes_done'] / 1e6:.1f}/"
                         f"{f'{total / 1e6:.1f}' if total else '?'} MB{share}")
        elif e["phase"] == "failed":
            parts.append(f"{e['model']}: failed: {e.get('error')}")
        else:
            parts.append(f"{e['model']}: {e['phase']}")
    return "; ".join(parts)


async def phases(backend: Any, names: tuple[str, ...]) -> list[dict[str, Any]]:
    """The board's entries for the served `names` (a backend without `model_status`: none)."""
    reader = getattr(backend, "model_status", None)
    return [] if reader is None else [e for e in await reader() if e.get("model") in names]


def admin_route(backend: Any, names: tuple[str, ...]) -> Any:
    """GET /admin/models: every replica's phase and download progress."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"models": await phases(backend, names)})
    return Route("/admin/models", models, methods=["GET"])
