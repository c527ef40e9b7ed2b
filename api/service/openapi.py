"""The OpenAPI description the ingress publishes at `GET /openapi.json` (no Ray).

Built from the configured limits, so a schema-driven client or fuzzer (tests/e2e/test_reliability_fuzz.py)
sees the bounds this server enforces. Schemas stay within the subset JSON Schema draft 7 and
OpenAPI 3.1 share (no `prefixItems`, no `$defs` across documents), so draft-7 tools read them too.
The parsers (api/core/fields.py and each dialect room's) stay the authority: the schema describes,
the parser decides.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.types import MAX_LOGPROBS

from api.core.fields import MAX_CACHE_SALT, MAX_METADATA_KEY, MAX_METADATA_PAIRS, MAX_METADATA_VALUE, MAX_SEED, Limits
from api.openai.chat import ROLES
from api.openai.completions import MAX_COMPLETION_LOGPROBS

JSON = "application/json"


def _number(lo: float, hi: float) -> dict[str, Any]:
    return {"type": "number", "minimum": lo, "maximum": hi}


def sampling_schema(limits: Limits, max_tokens: int) -> dict[str, Any]:
    """Fields chat and completions share."""
    limit = min(limits.max_tokens or max_tokens, max_tokens)
    stop_item = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars}
    return {
        "model": {"type": "string", "minLength": 1},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": limit},
        "temperature": _number(0, 2), "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1, "maximum": 1000}, "min_p": _number(0, 1),
        "presence_penalty": _number(-2, 2), "frequency_penalty": _number(-2, 2),
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
        "seed": {"type": "integer", "minimum": 0, "maximum": MAX_SEED},
        "stop": {"anyOf": [stop_item, {"type": "array", "items": stop_item, "maxItems": limits.max_stop}]},
        "stream": {"type": "boolean"},
        "user": {"type": "string", "maxLength": 256},
        "ignore_eos": {"type": "boolean", "description": "vLLM-style extension: generate past end-of-sequence"},
        "cache_salt": CACHE_SALT,
    }


CACHE_SALT = {"type": "string", "maxLength": MAX_CACHE_SALT,
              "description": "vLLM's extension: only requests with the same salt (and tenant) share cached prefixes"}
METADATA = {"type": "object", "maxProperties": MAX_METADATA_PAIRS,
            "propertyNames": {"maxLength": MAX_METADATA_KEY},
            "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE}}
TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}, "description": {"type": "string"},
        "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}}}
TOOL_CHOICE = {"anyOf": [{"enum": ["auto", "none", "required"]}, {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"enum": ["function"]}, "function": {"type": "object", "required": ["name"],
                                                     "properties": {"name": {"type": "string"}}}}}]}
RESPONSE_FORMAT = {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["text", "json_object", "json_schema"]},
    "json_schema": {"type": "object", "required": ["name", "schema"], "properties": {
        "name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}}


def chat_schema(limits: Limits, max_tokens: int) -> dict[str, Any]:
    message = {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"enum": sorted(ROLES)},
                              "content": {"type": ["string", "null"], "maxLength": 2000},
                              "tool_call_id": {"type": "string"},
                              "tool_calls": {"type": "array", "items": {"type": "object"}}}}
    props = sampling_schema(limits, max_tokens)
    props.update(messages={"type": "array", "items": message, "minItems": 1, "maxItems": limits.max_messages},
                 max_completion_tokens=props["max_tokens"], logprobs={"type": "boolean"},
                 top_logprobs={"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
                 tools={"type": "array", "items": TOOL, "maxItems": 128}, tool_choice=TOOL_CHOICE,
                 parallel_tool_calls={"type": "boolean"}, response_format=RESPONSE_FORMAT,
                 n={"type": "integer", "minimum": 1, "maximum": 16},
                 logit_bias={"type": "object", "additionalProperties": _number(-100, 100)},
                 separate_reasoning={"type": "boolean", "description": "false: keep reasoning inline in content"},
                 chat_template_kwargs={"type": "object", "description": "passed to the chat template"})
    return {"type": "object", "required": ["model", "messages"], "properties": props}


def completion_schema(limits: Limits, max_tokens: int) -> dict[str, Any]:
    props = sampling_schema(limits, max_tokens)
    props.update(prompt={"anyOf": [{"type": "string", "minLength": 1, "maxLength": 4000},
                                   {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1,
                                    "maxItems": 512}]},
                 logprobs={"type": "integer", "minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS})
    return {"type": "object", "required": ["model", "prompt"], "properties": props}


def _text(max_length: int = 2000) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


def _kind(kind: str, required: list[str], **props: Any) -> dict[str, Any]:
    """An object tagged by its "type" (a content block or an input item)."""
    return {"type": "object", "required": ["type", *required], "properties": {"type": {"enum": [kind]}, **props}}


TEXT_BLOCK = _kind("text", ["text"], text=_text())
TOOL_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}


def messages_schema(limits: Limits, max_tokens: int, counting: bool = False) -> dict[str, Any]:
    """Anthropic's /v1/messages body (`counting`: /v1/messages/count_tokens, no max_tokens or stream).
    `max_tokens` above the server's limit is accepted and clamped (clients size it for Claude)."""
    result = {"anyOf": [_text(), {"type": "array", "items": TEXT_BLOCK, "maxItems": 4}]}
    block = {"anyOf": [TEXT_BLOCK,
                       _kind("tool_use", ["id", "name", "input"], id={"type": "string", "minLength": 1},
                             name=TOOL_NAME, input={"type": "object"}),
                       _kind("tool_result", ["tool_use_id"], tool_use_id={"type": "string", "minLength": 1},
                             content=result, is_error={"type": "boolean"}),
                       _kind("thinking", ["thinking"], thinking=_text(), signature={"type": "string"})]}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["user", "assistant"]},
        "content": {"anyOf": [_text(), {"type": "array", "items": block, "minItems": 1, "maxItems": 4}]}}}
    tool = {"type": "object", "required": ["name", "input_schema"], "properties": {
        "name": TOOL_NAME, "description": {"type": "string"}, "input_schema": {"type": "object"},
        "strict": {"type": "boolean"}, "cache_control": {"type": "object"}}}
    choice = {"anyOf": [
        {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["auto", "any", "none"]}, "disable_parallel_tool_use": {"type": "boolean"}}},
        {"type": "object", "required": ["type", "name"], "properties": {
            "type": {"enum": ["tool"]}, "name": {"type": "string"}, "disable_parallel_tool_use": {"type": "boolean"}}}]}
    props: dict[str, Any] = {
        "model": {"type": "string", "minLength": 1},
        "system": {"anyOf": [_text(), {"type": "array", "items": TEXT_BLOCK, "maxItems": 4}]},
        "messages": {"type": "array", "items": message, "minItems": 1, "maxItems": limits.max_messages},
        "tools": {"type": "array", "items": tool, "maxItems": 128}, "tool_choice": choice,
        "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1,
                                                      "maxLength": limits.max_stop_chars},
                           "maxItems": limits.max_stop},
        "cache_salt": CACHE_SALT,
        "temperature": _number(0, 1), "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0, "maximum": 1000},
        "metadata": {"type": "object", "properties": {"user_id": {"type": "string", "maxLength": 256}}},
        "thinking": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["enabled", "disabled", "adaptive"]}, "budget_tokens": {"type": "integer", "minimum": 1}}},
        "output_config": {"type": "object", "properties": {"format": {
            "type": "object", "required": ["type", "schema"], "properties": {
                "type": {"enum": ["json_schema"]}, "schema": {"type": "object"}}}}},
        "service_tier": {"enum": ["auto", "standard_only"]},
    }
    if counting:
        return {"type": "object", "required": ["model", "messages"], "properties": props}
    props.update(max_tokens={"type": "integer", "minimum": 1, "maximum": max(max_tokens, 64000),
                             "description": f"clamped to {min(limits.max_tokens or max_tokens, max_tokens)}"},
                 stream={"type": "boolean"})
    return {"type": "object", "required": ["model", "max_tokens", "messages"], "properties": props}


def responses_schema(limits: Limits, max_tokens: int) -> dict[str, Any]:
    """OpenAI's /v1/responses body (function tools only; see api/responses/parse.py)."""
    parts = {"type": "array", "items": _kind("input_text", ["text"], text=_text()), "minItems": 1, "maxItems": 4}
    item = {"anyOf": [
        {"type": "object", "required": ["role", "content"], "properties": {
            "type": {"enum": ["message"]}, "role": {"enum": ["user", "system", "developer", "assistant"]},
            "content": {"anyOf": [_text(), parts]}}},
        _kind("function_call", ["call_id", "name", "arguments"], call_id={"type": "string", "minLength": 1},
              name=TOOL_NAME, arguments={"type": "string", "maxLength": 200}),
        _kind("function_call_output", ["call_id", "output"], call_id={"type": "string", "minLength": 1},
              output=_text())]}
    tool = _kind("function", ["name"], name=TOOL_NAME, description={"type": "string"},
                 parameters={"type": "object"}, strict={"type": "boolean"})
    fmt = {"anyOf": [{"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
                     _kind("json_schema", ["schema"], name={"type": "string"}, schema={"type": "object"},
                           strict={"type": "boolean"})]}
    limit = min(limits.max_tokens or max_tokens, max_tokens)
    props = {
        "model": {"type": "string", "minLength": 1},
        "input": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 2000},
                            {"type": "array", "items": item, "minItems": 1, "maxItems": limits.max_messages}]},
        "instructions": _text(), "tools": {"type": "array", "items": tool, "maxItems": 128},
        "tool_choice": {"anyOf": [{"enum": ["auto", "none", "required"]},
                                  _kind("function", ["name"], name={"type": "string"})]},
        "parallel_tool_calls": {"type": "boolean"},
        "max_output_tokens": {"type": "integer", "minimum": 1, "maximum": limit},
        "temperature": _number(0, 2), "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "text": {"type": "object", "properties": {"format": fmt, "verbosity": {"enum": ["low", "medium", "high"]}}},
        "reasoning": {"type": "object", "properties": {
            "effort": {"enum": ["none", "minimal", "low", "medium", "high", "xhigh"]}}},
        "stream": {"type": "boolean"}, "store": {"type": "boolean"},
        "previous_response_id": {"type": "string", "minLength": 1},
        "metadata": METADATA, "cache_salt": CACHE_SALT,
        "stop": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars},
                 "maxItems": limits.max_stop},
        "user": {"type": "string", "maxLength": 256}, "truncation": {"enum": ["auto", "disabled"]},
    }
    return {"type": "object", "required": ["model", "input"], "properties": props}


ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"enum": ["error"]}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}


def _responses(ok: str, error: str = "Error") -> dict[str, Any]:
    err = {"content": {JSON: {"schema": {"$ref": f"#/components/schemas/{error}"}}}}
    return {"200": {"description": ok}, "400": {"description": "invalid request", **err},
            "401": {"description": "missing or wrong API key", **err},
            "404": {"description": "unknown model", **err}, "413": {"description": "body too large", **err},
            "429": {"description": "queue full: retry after Retry-After seconds", **err},
            "503": {"description": "no model replica can serve yet", **err},
            "504": {"description": "engine.request_timeout_s ran out", **err}}


def _post(summary: str, schema: str, error: str = "Error",
          ok: str = "a completion (JSON), or server-sent events with \"stream\": true") -> dict[str, Any]:
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        JSON: {"schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": _responses(ok, error)}}


def _get(summary: str) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": "JSON"}}}}


def openapi_document(limits: Limits, max_tokens: int, model: str) -> dict[str, Any]:
    admin_post = {"post": {"summary": "cache administration", "responses": {"200": {"description": "JSON"}}}}
    clear = {"post": {"summary": "empty a prefix-cache tier", "parameters": [
        {"name": "tier", "in": "query", "schema": {"enum": ["ram", "ssd", "all"]}}],
        "responses": {"200": {"description": "cache stats after"}, "400": {"description": "unknown tier"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "Pomona", "version": "1", "description": f"OpenAI-compatible API serving {model!r}."},
        "components": {
            "schemas": {"ChatCompletionRequest": chat_schema(limits, max_tokens),
                        "CompletionRequest": completion_schema(limits, max_tokens),
                        "MessagesRequest": messages_schema(limits, max_tokens),
                        "CountTokensRequest": messages_schema(limits, max_tokens, counting=True),
                        "ResponsesRequest": responses_schema(limits, max_tokens),
                        "Error": ERROR, "AnthropicError": ANTHROPIC_ERROR},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/chat/completions": _post("chat completion", "ChatCompletionRequest"),
            "/v1/completions": _post("text completion", "CompletionRequest"),
            "/v1/messages": _post("Anthropic Messages", "MessagesRequest", "AnthropicError"),
            "/v1/messages/count_tokens": _post("Anthropic token count", "CountTokensRequest", "AnthropicError",
                                               ok="{\"input_tokens\": n}"),
            "/v1/responses": _post("OpenAI Responses", "ResponsesRequest"),
            "/v1/responses/{response_id}": {**_get("a stored response"), "delete": {
                "summary": "delete a stored response", "responses": _responses("deleted")}},
            "/v1/responses/{response_id}/input_items": {"get": {
                "summary": "a stored response's input items", "parameters": [
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                    {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
                    {"name": "after", "in": "query", "schema": {"type": "string"}}],
                "responses": _responses("a list of input items")}},
            "/v1/models": _get("the served model"),
            "/health": {"get": {"summary": "200 once a model replica serves, else 503", "security": [],
                                "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}}}},
            "/metrics": _get("Prometheus text"),
            "/admin/requests": _get("running and queued requests per replica"),
            "/admin/cache": _get("prefix-cache statistics per replica"),
            "/admin/cache/clear": clear,
            "/admin/cache/flush": admin_post,
            "/admin/reset": admin_post,
        },
    }


def openapi_route(limits: Limits, max_tokens: int, model: str) -> Route:
    """`GET /openapi.json`; built once, since limits do not change while the app runs."""
    document = openapi_document(limits, max_tokens, model)

    async def publish(request: Request) -> Response:
        return JSONResponse(document)
    return Route("/openapi.json", publish, methods=["GET"])
