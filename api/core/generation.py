"""The generation pipeline shared by every dialect: a `Conversation` (or a text completion's
`TextPrompt`) in, `OutputEvent`s and a `Completion` out (no Ray, no HTTP shapes).

Prompt rendering (the model's chat template, or the generic tool fallback), grammar choice and
compilation, the engine stream and the split of its text into content / reasoning / tool calls
all happen here once, so the OpenAI chat, Anthropic Messages and OpenAI Responses routes differ
only in how they parse requests and render answers. A `TextPrompt` skips the template, the grammar
and the parser: its prompt is encoded as it is and its text comes back as the engine wrote it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol

from mlx_lm.tool_parsers import json_tools

from engine.types import MAX_STOP_STRINGS, SamplingParams

from api.core.conversation import Completion, Conversation, OutputEvent, TextDelta, TextPrompt, Tool, Usage
from api.core.errors import invalid, server_error
from api.core.prompt_tokens import IncrementalEncoder
from api.core.streaming import Tracker
from api.core.wire import SALT_KEY, sampling_to_wire
from api.output.grammars import (GrammarError, answer_grammar, check_grammar, no_call_grammar, special_marker_id,
                                 tool_grammar)
from api.output.parser import OutputParser
from api.output.tool_syntax import TemplateError, ToolSyntax, render_prompt, syntax_for


class Host(Protocol):
    """What the pipeline needs from the HTTP server (api.service.server.OpenAIServer)."""

    backend: Any
    settings: Any
    metrics: Any

    def require_ready(self) -> Any: ...
    async def on_tok(self, fn: Callable[[], Any]) -> Any: ...
    def check_model(self, name: str) -> None: ...
    def salt(self, request: Any, own: str) -> str: ...
    async def first(self, stream: AsyncIterator[Any]) -> list[Any]: ...


@dataclass(frozen=True)
class Prepared:
    """A request made ready for the engine: its prompt tokens and wire sampling settings. A text
    prompt has no `syntax`: its output is not parsed."""

    conversation: Conversation | TextPrompt
    tokens: tuple[int, ...]
    params: dict[str, Any]
    syntax: ToolSyntax | None
    starts_in_reasoning: bool
    added_stop: str | None = None  # the call end marker added as a stop string: never reported as one


def _tool_dicts(tools: tuple[Tool, ...]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in tools]


def _opens_reasoning(tokenizer: Any, prompt: str) -> bool:
    """Whether the prompt ends inside an open think section (templates with enable_thinking do)."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    return prompt.rfind(tokenizer.think_start) > prompt.rfind(tokenizer.think_end)


def _end_at_first_call(conv: Conversation, sampling: SamplingParams, syntax: ToolSyntax,
                       tokenizer: Any) -> tuple[SamplingParams, str | None]:
    """`parallel_tool_calls` false under "auto": the engine stops at the first call's end marker (a
    stop token when the marker is one special token, else a stop string), so the answer holds at most
    one call and no tokens are spent on a second. The parser keeps only the first call in any case
    (a syntax without an end marker, one section holding several calls). "required" / "named" need
    nothing: their grammar allows one call. The added stop string is not reported as a stop sequence.

    Side effect, accepted: an end marker the model writes outside a call (in prose, in reasoning)
    ends the answer there too; that text is call markup that would not reach the client anyway."""
    if conv.parallel_tool_calls or not conv.tools or conv.tool_choice.mode != "auto" or not syntax.end:
        return sampling, None
    end_token = special_marker_id(tokenizer, syntax.end)
    if end_token is not None:
        return dataclasses.replace(sampling, stop_token_ids=sampling.stop_token_ids + (end_token,)), None
    if syntax.end in sampling.stop:
        return sampling, None  # the client's own stop: reported as theirs
    if len(sampling.stop) >= MAX_STOP_STRINGS:
        return sampling, None  # no room for one more: the parser still keeps only the first call
    return dataclasses.replace(sampling, stop=sampling.stop + (syntax.end,)), syntax.end


class Pipeline:
    def __init__(self, host: Host) -> None:
        self.host = host
        self._syntax: tuple[Any, ToolSyntax] | None = None  # (tokenizer, its syntax)
        self._encoder: IncrementalEncoder | None = None

    def encoder(self, tokenizer: Any) -> IncrementalEncoder:
        """The prompt encoder of this tokenizer (api/core/prompt_tokens.py: an agent's resent conversation
        is not encoded again)."""
        if self._encoder is None or self._encoder.tokenizer is not tokenizer:
            self._encoder = IncrementalEncoder(tokenizer)
        return self._encoder

    def syntax(self, tokenizer: Any) -> ToolSyntax:
        if self._syntax is None or self._syntax[0] is not tokenizer:
            self._syntax = (tokenizer, syntax_for(tokenizer, self.host.settings.tool_parser))
        return self._syntax[1]

    async def render(self, conv: Conversation, salt: str | None = None) -> tuple[str, list[int], ToolSyntax]:
        """The prompt text and its tokens; a template that refuses the messages is the client's 400.
        With the caller's `salt`, the tokens of an earlier prompt of that salt that this one extends
        are reused (api/core/prompt_tokens.py); None: encoded whole, nothing remembered."""
        ready = self.host.require_ready()
        tok = ready.tokenizer
        if not getattr(tok, "chat_template", None):
            raise invalid("This model has no chat template; use /v1/completions with a plain prompt.")
        syntax = self.syntax(tok)

        encoder = self.encoder(tok)

        def work() -> tuple[str, list[int]]:
            text = render_prompt(tok, conv.messages, conv.tools, syntax, dict(conv.chat_template_kwargs))
            if salt is None:
                return text, list(tok.encode(text, add_special_tokens=False))
            return text, encoder.encode(text, salt)
        try:
            text, tokens = await self.host.on_tok(work)
        except TemplateError as exc:
            raise invalid(str(exc), param="messages")
        return text, tokens, syntax

    async def count_tokens(self, conv: Conversation) -> int:
        self.host.check_model(conv.model)
        return len((await self.render(conv))[1])

    def grammar(self, conv: Conversation, syntax: ToolSyntax, tokenizer: Any) -> tuple[str | None, str]:
        """The request's grammar (or None) and the client's field it came from."""
        choice, tools = conv.tool_choice, conv.tools
        start, end = special_marker_id(tokenizer, syntax.start), special_marker_id(tokenizer, syntax.end)
        if tools and choice.mode == "none" and conv.output_format.kind == "text":
            # The tools stay in the prompt (so the next turn's prefix is cached); the grammar keeps
            # the model from writing a call, which "none" promises.
            return no_call_grammar(syntax.start, start), conv.tools_param
        if tools and choice.mode != "none":
            forced = choice.mode in ("required", "named") or any(t.strict for t in tools)
            if forced and (syntax.json_body or choice.mode != "auto"):
                return tool_grammar(tools, choice, conv.parallel_tool_calls, syntax.start, syntax.end,
                                    allow_text=False, start_token=start, end_token=end), conv.tools_param
        return answer_grammar(conv.output_format), conv.format_param

    async def prepare(self, conv: Conversation | TextPrompt, salt: str = "") -> Prepared:
        """`salt`: the request's prefix-cache partition (the caller's tenant and the request's own
        `cache_salt`, api/service/auth.py `cache_salt`); it travels beside the sampling settings."""
        if isinstance(conv, TextPrompt):
            return await self._prepare_text(conv, salt)
        self.host.check_model(conv.model)
        ready = self.host.require_ready()
        text, tokens, syntax = await self.render(conv, salt)
        if conv.sampling.logit_bias and max(t for t, _ in conv.sampling.logit_bias) >= ready.vocab_size:
            raise invalid(f"'logit_bias' token ids must be below the vocabulary size {ready.vocab_size}.",
                          param="logit_bias")
        try:
            grammar, param = self.grammar(conv, syntax, ready.tokenizer)
            if grammar is not None:
                await self.host.on_tok(lambda: check_grammar(grammar))
        except GrammarError as exc:
            raise invalid(f"The schema cannot be used: {exc}. Fix the schema.", param=param)
        if grammar is not None and param == conv.tools_param and not syntax.json_body:
            # The grammar wrote the call as JSON between the model's own markers: parse it as such.
            syntax = dataclasses.replace(syntax, name="json_tools", parse=json_tools.parse_tool_call, json_body=True)
        sampling = dataclasses.replace(conv.sampling, max_tokens=self._max_tokens(conv, len(tokens), ready),
                                       grammar=grammar)
        sampling, added = _end_at_first_call(conv, sampling, syntax, ready.tokenizer)
        return Prepared(conv, tuple(tokens), {**sampling_to_wire(sampling), SALT_KEY: salt}, syntax,
                        _opens_reasoning(ready.tokenizer, text), added)

    async def _prepare_text(self, req: TextPrompt, salt: str) -> Prepared:
        """A text completion's prompt: token ids as sent (below the vocabulary), or its text encoded
        whole (special tokens as the tokenizer adds them); no template, no grammar."""
        self.host.check_model(req.model)
        ready = self.host.require_ready()
        if isinstance(req.prompt, tuple):
            if max(req.prompt) >= ready.vocab_size:
                raise invalid(f"'prompt' token ids must be below the vocabulary size {ready.vocab_size}.",
                              param="prompt")
            tokens = list(req.prompt)
        else:
            tok, text = ready.tokenizer, req.prompt
            tokens = list(await self.host.on_tok(lambda: tok.encode(text)))
        sampling = dataclasses.replace(req.sampling, max_tokens=self._max_tokens(req, len(tokens), ready, "prompt"))
        return Prepared(req, tuple(tokens), {**sampling_to_wire(sampling), SALT_KEY: salt}, None, False)

    def _max_tokens(self, conv: Conversation | TextPrompt, n_prompt: int, ready: Any, param: str = "messages") -> int:
        """The request's max_tokens once its prompt's length is known; `param` names the prompt's field."""
        context, limit = ready.context_length, self.host.settings.limits.max_prompt_tokens
        if limit is not None and n_prompt > limit:
            raise invalid(f"The prompt has {n_prompt} tokens; this server accepts at most {limit}. "
                          "Shorten the prompt.", param=param, code="context_length_exceeded")
        max_tokens, room = conv.max_tokens, context - n_prompt
        if max_tokens is None:  # as much as fits, bounded by the server's default
            max_tokens = min(self.host.settings.engine.default_max_tokens, room)
        elif isinstance(conv, Conversation) and conv.max_tokens_cap and 1 <= room < max_tokens:
            max_tokens = room
        if max_tokens < 1 or n_prompt + max_tokens > context:
            need = max(max_tokens, 1)
            raise invalid(f"This model's maximum context length is {context} tokens, but the request needs "
                          f"{n_prompt + need} ({n_prompt} in the prompt + {need} for the completion). "
                          "Shorten the prompt or lower max_tokens.", param=param,
                          code="context_length_exceeded")
        return max_tokens

    def parser(self, prepared: Prepared) -> OutputParser | None:
        """None for a text prompt: its text is the answer as the engine wrote it."""
        conv = prepared.conversation
        if isinstance(conv, TextPrompt) or prepared.syntax is None:
            return None
        tok = self.host.require_ready().tokenizer
        has_thinking = getattr(tok, "has_thinking", False)
        return OutputParser(prepared.syntax, _tool_dicts(conv.tools),
                            think_start=tok.think_start if has_thinking else None,
                            think_end=tok.think_end if has_thinking else None,
                            reasoning_inline=conv.reasoning_inline,
                            tools_enabled=bool(conv.tools) and conv.tool_choice.mode != "none",
                            starts_in_reasoning=prepared.starts_in_reasoning,
                            max_calls=None if conv.parallel_tool_calls else 1)

    async def start(self, prepared: Prepared, rid: str, choice: int = 0) -> "Run":
        """Start one choice; raises ApiError when the engine refuses it before the first token."""
        params = dict(prepared.params)
        if choice and params.get("seed") is not None:
            params["seed"] = int(params["seed"]) + choice  # n choices with a seed: distinct, reproducible
        started = time.monotonic()
        stream = self.host.backend.stream(list(prepared.tokens), params, rid if not choice else f"{rid}-{choice}")
        try:
            first = await self.host.first(stream)
        except BaseException:
            await stream.aclose()
            raise
        return Run(stream, first, self.parser(prepared), Tracker(self.host.metrics, started), self.host.metrics,
                   prepared.added_stop)


class Run:
    """One choice in flight: iterate it for lists of `OutputEvent` (one list per engine batch)."""

    def __init__(self, stream: Any, first: list[Any], parser: OutputParser | None, tracker: Tracker, metrics: Any,
                 added_stop: str | None = None) -> None:
        self._stream, self._first, self._parser = stream, first, parser
        self._added_stop = added_stop
        self.tracker, self._metrics = tracker, metrics
        self.completion: Completion | None = None
        self.batch_logprobs: list[dict[str, Any]] = []  # the latest batch's, for streamed logprobs
        self._closed = False
        metrics.in_flight.inc()

    async def __aiter__(self) -> AsyncIterator[list[OutputEvent]]:
        batch: list[Any] | None = self._first
        while batch is not None:
            text, self.batch_logprobs = self.tracker.add(batch)
            if self.tracker.error is not None:
                raise self.tracker.error
            events = self._feed(text) if text else []
            if self.tracker.done:
                events += self._parser.finish(self.tracker.finish or "stop") if self._parser is not None else []
                self.completion = self._complete(batch[-1] if batch else {})
                yield events
                return
            if events or self.batch_logprobs:
                yield events
            try:
                batch = await self._stream.__anext__()
            except StopAsyncIteration:
                raise server_error("The model server ended the stream early; retry the request.")

    def _feed(self, text: str) -> list[OutputEvent]:
        return self._parser.feed(text) if self._parser is not None else [TextDelta(text)]

    def _complete(self, final: dict[str, Any]) -> Completion:
        u = self.tracker.usage
        usage = Usage(int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0)),
                      int(u.get("cached_tokens", 0)))
        p, stop = self._parser, final.get("stop_str")
        if p is None:  # a text prompt: the engine's text and finish as they came
            return Completion(text="".join(self.tracker.text), reasoning="", tool_calls=(),
                              finish=self.tracker.finish or "stop", usage=usage,  # type: ignore[arg-type]
                              stop_sequence=stop, logprobs=tuple(self.tracker.logprobs))
        return Completion(text=p.text, reasoning=p.reasoning, tool_calls=p.tool_calls,
                          finish=p.finish_reason(self.tracker.finish or "stop"), usage=usage,
                          stop_sequence=None if stop == self._added_stop else stop,
                          logprobs=tuple(self.tracker.logprobs))

    async def drain(self) -> Completion:
        async for _ in self:
            pass
        assert self.completion is not None
        return self.completion

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._metrics.in_flight.dec()
        if not self.tracker.done:
            self._metrics.disconnects.inc()
        await self._stream.aclose()  # cancels the LLM server's generator


async def start_all(pipeline: Pipeline, prepared: Prepared, rid: str, n: int) -> list[Run]:
    """Start n choices of one prompt together: the engine computes the shared prompt once (a waiting
    prompt that shares a prefill in progress waits for its cache) and each choice samples its own.

    A run counts itself in flight until it is closed, so none may be lost: a client that leaves
    while the choices start cancels this call, and the choices that had started are closed here
    (`gather` would drop their results: the in-flight gauge stayed up and the engine kept decoding
    for nobody, seen in tests/e2e/test_reliability_overload.py's soak)."""
    if n == 1:  # no task: a cancellation lands inside `start`, which closes its stream itself
        return [await pipeline.start(prepared, rid, 0)]
    tasks = [asyncio.ensure_future(pipeline.start(prepared, rid, i)) for i in range(n)]
    try:
        await asyncio.wait(tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)
        await close_all([t.result() for t in tasks if not t.cancelled() and t.exception() is None])
        raise
    runs = [t.result() for t in tasks if t.exception() is None]
    failed = [t.exception() for t in tasks if t.exception() is not None]
    if failed:
        await close_all(runs)
        raise failed[0]
    return runs


async def close_all(runs: list[Run]) -> None:
    for run in runs:
        await run.close()


async def merged(runs: list[Run]) -> AsyncIterator[tuple[int, list[OutputEvent]]]:
    """The runs' event lists as they come, tagged with the choice index (one run: no tasks)."""
    if len(runs) == 1:
        async for events in runs[0]:
            yield 0, events
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, run: Run) -> None:
        try:
            async for events in run:
                await queue.put((i, events, None))
        except BaseException as exc:  # handed to the consumer, which raises it
            await queue.put((i, None, exc))
        else:
            await queue.put((i, None, None))
    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(runs)]
    try:
        left = len(runs)
        while left:
            i, events, exc = await queue.get()
            if exc is not None:
                raise exc
            if events is None:
                left -= 1
            else:
                yield i, events
    finally:
        for task in tasks:
            task.cancel()
