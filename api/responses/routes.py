"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{response_id}`,
`GET /v1/responses/{response_id}/input_items`.

Parsing is api/responses/parse.py, the response object and its events
api/responses/render.py, the store api/responses/store.py (its settings and
directory are documented there). Generation is the pipeline every dialect shares
(api/core/dialect.py `respond`).

`previous_response_id`: the route reads the body, fetches the predecessor from the store off the
event loop, and hands the dialect its stored conversation, which `parse` puts after this
request's `instructions` (instructions are not carried over, as on OpenAI) and before its
`input`. A stored response is written before its answer goes out (the last event of a stream), so
a follow-up sent right after finds it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.core.conversation import Completion, Conversation, Message
from api.core.dialect import Context, RouteHost, RouteSettings, respond
from api.core.errors import ApiError, invalid, not_found, server_error
from api.core.generation import Run, merged
from api.responses.parse import ParsedResponse, parse_responses, store_fields
from api.responses.render import EventWriter, input_items, item_page, output_items, response_object, status_of
from api.responses.store import ResponseStore, ResponseStoreSettings, StoredResponse

log = logging.getLogger("pomona.responses")
ROUTE = "/v1/responses"
ITEM_ROUTE = "/v1/responses/{response_id}"
INPUT_ITEMS_ROUTE = "/v1/responses/{response_id}/input_items"
MAX_PAGE = 100


class ResponsesSettings(RouteSettings, Protocol):
    """The settings the Responses routes read: every dialect's, and the store's (which defaults its
    directory beside the SSD tier's, `engine.cache.ssd_dir`)."""

    @property
    def responses(self) -> ResponseStoreSettings: ...


class ResponsesHost(RouteHost, Protocol):
    """The server as the Responses routes see it."""

    @property
    def settings(self) -> ResponsesSettings: ...


def error_response(err: ApiError) -> Response:
    return JSONResponse(err.body(), status_code=err.status, headers=dict(err.headers))


def _is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def answer_message(c: Completion) -> Message:
    """This turn's answer as the assistant message a follow-up's prompt will hold. A call whose
    arguments were cut off (max_output_tokens) is left out: no template can render it, and the
    client cannot repair history it does not send."""
    calls = tuple(call for call in c.tool_calls if _is_object(call.arguments))
    return Message("assistant", c.text, calls, reasoning=c.reasoning or None)


def _own_names(err: ApiError) -> ApiError:
    """The pipeline names chat's fields in its errors (the prompt is "messages"); say "input" and
    "max_output_tokens", this API's names for them."""
    if err.param != "messages":
        return err
    message = err.message.replace("lower max_tokens", "lower max_output_tokens")
    return ApiError(err.status, message, err.type, "input", err.code, err.headers)


class Responses:
    """The dialect for one request (it holds the predecessor's conversation and the parse result)."""

    id_prefix = "resp_"

    def __init__(self, server: ResponsesHost, store: "Store", previous: StoredResponse | None,
                 tenant: str = "") -> None:
        self.server, self.store, self.tenant = server, store, tenant
        self.history = previous.messages if previous is not None else ()
        # The predecessor's context as items: its own input items, then what it answered.
        self.history_items = (list(previous.input_items) + list(previous.response.get("output") or [])
                              if previous is not None else [])
        self.parsed: ParsedResponse | None = None
        self.answer: tuple[dict[str, Any], Completion] | None = None  # a whole answer, stored by the route

    def parse(self, body: dict[str, Any]) -> Conversation:
        settings = self.server.settings
        self.parsed = parse_responses(body, settings.limits, settings.engine.max_tokens_limit, self.history)
        return self.parsed.conversation

    def error(self, err: ApiError) -> Response:
        return error_response(_own_names(err))

    def _object(self, ctx: Context, **kw: Any) -> dict[str, Any]:
        assert self.parsed is not None
        return response_object(ctx.rid, ctx.created, ctx.model, self.parsed.echo,
                               previous=self.parsed.previous_response_id,
                               store=self.parsed.store and self.store.enabled, **kw)

    def whole(self, ctx: Context, completions: list[Completion]) -> dict[str, Any]:
        c = completions[0]
        obj = self._object(ctx, status=status_of(c), output=output_items(c), usage=c.usage)
        self.answer = (obj, c)
        return obj

    async def stream(self, ctx: Context, runs: list[Run]) -> AsyncIterator[str]:
        writer = EventWriter()
        started = self._object(ctx, status="in_progress", output=[], usage=None)
        yield writer.start(started)
        try:
            async for _, events in merged(runs):
                text = writer.feed(events)
                if text:
                    yield text
        except ApiError as err:  # the model server failed after the first token: say so, then end
            yield writer.failed(err, started)
            return
        except Exception:
            yield writer.failed(server_error("The server failed while streaming; retry the request."), started)
            raise
        c = runs[0].completion
        assert c is not None
        status = status_of(c)
        tail = writer.finish(status)
        obj = self._object(ctx, status=status, output=writer.items, usage=c.usage)
        if obj["store"]:
            obj["store"] = await self.save(obj, c)
        yield tail + writer.end(obj)

    async def save(self, obj: dict[str, Any], c: Completion) -> bool:
        """Store the response and the conversation so far; False (not stored) if the store fails."""
        assert self.parsed is not None
        messages = self.parsed.history + self.parsed.turn + (answer_message(c),)
        items = tuple(self.history_items + input_items(self.parsed.turn))
        return await self.store.put(obj["id"], StoredResponse({**obj, "store": True}, messages, items, self.tenant))


class Store:
    """The route's view of the store: async, off the event loop, errors mapped to API errors."""

    def __init__(self, server: ResponsesHost) -> None:
        settings = server.settings
        self.enabled = settings.responses.enabled
        self.backend = ResponseStore(settings.responses,
                                     settings.responses.resolved_directory(settings.engine.cache.ssd_dir))

    async def get(self, rid: str, tenant: str) -> StoredResponse | None:
        if not self.enabled:
            return None
        try:
            return await asyncio.to_thread(self.backend.get, rid, tenant)
        except Exception as exc:
            log.exception("the response store at %s failed on a read", self.backend.directory)
            raise server_error("The response store cannot be read; check the server log and the "
                               "'responses.directory' setting.") from exc

    async def put(self, rid: str, stored: StoredResponse) -> bool:
        try:
            await asyncio.to_thread(self.backend.put, rid, stored)
            return True
        except Exception:  # the answer is made: send it, saying it was not stored, rather than lose it
            log.exception("the response store at %s failed on a write; %s is not stored", self.backend.directory, rid)
            return False

    async def delete(self, rid: str, tenant: str) -> bool:
        return self.enabled and await asyncio.to_thread(self.backend.delete, rid, tenant)


def _not_stored(rid: str, param: str | None, code: str) -> ApiError:
    return not_found(f"No response with id {rid!r} is stored here: it is unknown, expired, deleted, or was made "
                     "with \"store\": false. Send the whole conversation as 'input' instead.", param=param, code=code)


class ResponseRoutes:
    def __init__(self, server: ResponsesHost) -> None:
        self.server, self.store = server, Store(server)

    async def _history(self, previous: str, tenant: str) -> StoredResponse:
        if not self.store.enabled:
            raise invalid("This server does not store responses (responses.enabled is false), so "
                          "'previous_response_id' cannot be used; send the whole conversation as 'input'.",
                          param="previous_response_id")
        stored = await self.store.get(previous, tenant)
        if stored is None:
            raise _not_stored(previous, "previous_response_id", "previous_response_not_found")
        return stored

    async def create(self, request: Request) -> Response:
        server, tenant = self.server, self.server.tenant(request)
        try:
            body = await server.read_json(request)
            _, previous = store_fields(body)
            history = await self._history(previous, tenant) if previous is not None else None
        except ApiError as err:
            server.metrics.count(ROUTE, err.status)
            return error_response(err)
        dialect = Responses(server, self.store, history, tenant)

        async def given(_: Request) -> dict[str, Any]:
            return body
        response = await respond(request, dialect, server.pipeline, given, server.model_name)
        if dialect.answer is not None and dialect.answer[0]["store"]:
            obj, completion = dialect.answer
            if not await dialect.save(obj, completion):
                response = JSONResponse({**obj, "store": False})
        return response

    async def retrieve(self, request: Request) -> Response:
        rid = request.path_params["response_id"]
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            err = invalid("Streaming a stored response again is not supported; retrieve it without 'stream'.",
                          param="stream")
        else:
            try:
                stored = await self.store.get(rid, self.server.tenant(request))
                if stored is not None:
                    self.server.metrics.count(ITEM_ROUTE, 200)
                    return JSONResponse(stored.response)
                err = _not_stored(rid, "response_id", "response_not_found")
            except ApiError as exc:
                err = exc
        self.server.metrics.count(ITEM_ROUTE, err.status)
        return error_response(err)

    async def input_items(self, request: Request) -> Response:
        """OpenAI's list of a stored response's input items: `limit` (1-100, default 20), `order`
        ("desc", the default, or "asc"), `after` (an item id, for the next page)."""
        rid, query = request.path_params["response_id"], request.query_params
        try:
            limit, order, after = _page_query(query.get("limit", "20"), query.get("order", "desc"), query.get("after"))
            stored = await self.store.get(rid, self.server.tenant(request))
            if stored is None:
                raise _not_stored(rid, "response_id", "response_not_found")
            page = item_page(list(stored.input_items), limit, order, after)
            if page is None:
                raise invalid(f"'after' names no input item of {rid}; send the last_id of the page before.",
                              param="after")
        except ApiError as err:
            self.server.metrics.count(INPUT_ITEMS_ROUTE, err.status)
            return error_response(err)
        self.server.metrics.count(INPUT_ITEMS_ROUTE, 200)
        return JSONResponse(page)

    async def delete(self, request: Request) -> Response:
        rid = request.path_params["response_id"]
        try:
            deleted = await self.store.delete(rid, self.server.tenant(request))
        except Exception:
            log.exception("the response store at %s failed on a delete", self.store.backend.directory)
            deleted, err = False, server_error("The response store failed; check the server log.")
        else:
            err = None if deleted else _not_stored(rid, "response_id", "response_not_found")
        self.server.metrics.count(ITEM_ROUTE, err.status if err else 200)
        return error_response(err) if err else JSONResponse({"id": rid, "object": "response", "deleted": True})


def routes(server: ResponsesHost) -> list[Route]:
    r = ResponseRoutes(server)
    return [Route(ROUTE, r.create, methods=["POST"]),
            Route(ITEM_ROUTE, r.retrieve, methods=["GET"]),
            Route(ITEM_ROUTE, r.delete, methods=["DELETE"]),
            Route(INPUT_ITEMS_ROUTE, r.input_items, methods=["GET"])]


def _page_query(limit: str, order: str, after: str | None) -> tuple[int, str, str | None]:
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_PAGE:
        raise invalid(f"'limit' must be an integer from 1 to {MAX_PAGE}, got {limit!r}.", param="limit")
    if order not in ("asc", "desc"):
        raise invalid(f"'order' must be \"asc\" or \"desc\", got {order!r}.", param="order")
    if after is not None and not after:
        raise invalid("'after' is empty; send an item id (the last_id of the page before) or leave it out.",
                      param="after")
    return int(limit), order, after
