"""OpenAI's text completions (`POST /v1/completions`): a plain prompt, no chat template, as a dialect
of the one route body (api.core.dialect.respond).

The body parses into a `TextPrompt` (api.core.conversation); the shared pipeline encodes it (or checks
its token ids), bounds it by the context, and starts it with no output parser, so the answer is the
engine's text as it came. This module renders it as OpenAI's `text_completion` objects.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Mapping

from starlette.responses import JSONResponse, Response

from api.core.conversation import Completion, TextDelta, TextPrompt
from api.core.dialect import Context
from api.core.errors import ApiError, invalid
from api.core.fields import Limits, read_field, sampling_fields
from api.core.generation import Run
from api.core.streaming import SSE_DONE, error_event, sse
from api.openai.common import common_fields
from api.openai.shapes import LogprobFormatter, completion_response, completion_usage_chunk

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's own bound for /v1/completions


def parse_completion(body: Mapping[str, Any], limits: Limits, engine_max_tokens: int) -> TextPrompt:
    common = common_fields(body, limits, engine_max_tokens)
    logprobs = read_field(body, "logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise invalid(f"'logprobs' must be between 0 and {MAX_COMPLETION_LOGPROBS}.", param="logprobs")
    sampling = sampling_fields(body, limits, logprobs)
    return TextPrompt(sampling=sampling, prompt=_prompt(body.get("prompt")), logprobs=logprobs is not None,
                      **common)


def _prompt(value: Any) -> str | tuple[int, ...]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise invalid("'prompt' is empty; send some text.", param="prompt")
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if min(value) < 0:
            raise invalid("'prompt' token ids must be >= 0.", param="prompt")
        return tuple(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise invalid("Send one prompt per request (batches of prompts are not supported).", param="prompt")
    raise invalid("'prompt' must be a non-empty string or array of token ids.", param="prompt")



class OpenAICompletions:
    """The text-completions dialect of `respond`: one choice, the engine's text as it came."""

    id_prefix = "cmpl-"

    def __init__(self, limits: Limits, engine_max_tokens: int, decode: Callable[[], Callable[[int], str]]) -> None:
        """`decode`: called once a replica is ready, gives token id -> text (for logprobs)."""
        self.limits, self.engine_max_tokens, self.decode = limits, engine_max_tokens, decode

    def parse(self, body: dict[str, Any]) -> TextPrompt:
        return parse_completion(body, self.limits, self.engine_max_tokens)

    def error(self, err: ApiError) -> Response:
        return JSONResponse(err.body(), status_code=err.status, headers=dict(err.headers))

    def whole(self, ctx: Context, completions: list[Completion]) -> dict[str, Any]:
        c, want = completions[0], ctx.conversation.logprobs
        u = c.usage
        usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                 "cached_tokens": u.cached_tokens}
        lps = LogprobFormatter(self.decode()).completion(c.logprobs, 0) if want else None
        return completion_response(ctx.rid, ctx.created, ctx.model, c.text, c.finish, usage, lps)

    async def stream(self, ctx: Context, runs: list[Run]) -> AsyncIterator[str]:
        """One SSE write per engine batch; the last batch's chunk, the usage chunk (when asked for)
        and `[DONE]` go out together. An error after the first token is an error event, then `[DONE]`."""
        run, prompt, fmt = runs[0], ctx.conversation, LogprobFormatter(self.decode())

        def chunk(text: str, lps: list[dict[str, Any]], finish: str | None, offset: int) -> str:
            body = completion_response(ctx.rid, ctx.created, ctx.model, text, finish, None,
                                       fmt.completion(lps, offset) if prompt.logprobs else None, stream=True)
            if prompt.include_usage:
                body["usage"] = None  # OpenAI sends null on every chunk but the last when usage is asked for
            return sse(body)
        pending: list[str] = []
        try:
            async for events in run:
                text = "".join(e.text for e in events if isinstance(e, TextDelta))
                lps, finish = run.batch_logprobs, run.tracker.finish
                if text or lps or finish:
                    pending.append(chunk(text, lps, finish, run.tracker.batch_offset))
                if run.completion is None and pending:
                    yield "".join(pending)
                    pending = []
        except ApiError as err:  # the model server failed after the first token: say so, then end
            pending.append(error_event(err))
        else:
            if prompt.include_usage:
                pending.append(sse(completion_usage_chunk(ctx.rid, ctx.created, ctx.model, run.tracker.usage)))
        yield "".join(pending) + SSE_DONE
