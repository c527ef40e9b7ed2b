"""Split one choice's streamed text into content, reasoning and tool calls (`OutputEvent`s).

mlx-lm's `TextStateMachine` does the normal / reasoning / tool split on text (markers may arrive
split anywhere; it holds back what could be the start of one and strips the markers). Each tool
section (the text between a call's start and end markers) is parsed with the syntax's mlx-lm
`parse_tool_call`. On top of that:

- JSON bodies (`{"name": ..., "arguments": {...}}`, json_tools and the generic fallback) stream:
  `ToolCallStart` as soon as the name string is complete, then the arguments object's own text in
  `ToolArgsDelta` pieces as it is generated (held until the name is known when "arguments" comes
  first), then `ToolCallEnd` at the end marker. The reported `arguments` is exactly the text
  streamed (validated to be a JSON object), so clients that concatenate deltas get the same
  string. Further JSON calls after the first object in the same block are sent whole; other text
  there (a stray brace) is ignored. Other syntaxes (XML, pythonic, ...) and JSON bodies whose
  arguments are not an object are sent whole at their end marker: one start, one delta with
  `json.dumps(arguments, ensure_ascii=False)`, one end. Ids: the parser's (kimi_k2, mistral) or
  `call_` + 24 hex digits.
- A section that cannot be parsed as calls (malformed, or cut off by max_tokens before its name
  was known) is dropped with a warning, as mlx_lm.server does, and counted in `dropped_calls`:
  call markup never reaches content (the most common complaint about the peers is raw markup in
  `content`, which breaks agent clients that display or re-send it).
- A streamed call whose start already went out but whose arguments then break (cut by "length",
  or invalid JSON) still ends with `ToolCallEnd`, its `arguments` the text sent so far: the client
  already holds the call, as OpenAI's own truncated calls look. Its index is in `invalid_calls`.
- Whitespace-only content next to a call (the "\\n" between `</tool_call>` and the next
  `<tool_call>`, or after the last one) is not content; other content is sent as generated.
- With `reasoning_inline` (or no think markers) the think markers are ordinary text.
- `max_calls` (1 for `parallel_tool_calls: false`): calls after that many are left out, neither
  sent nor counted as dropped; their markup never reaches content either.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from typing import Any, Sequence

from mlx_lm.generate import TextStateMachine

from api.core.conversation import (OutputEvent, ReasoningDelta, TextDelta, ToolArgsDelta, ToolCall,
                                   ToolCallEnd, ToolCallStart)
from api.output.call_scanner import CallScanner
from api.output.tool_syntax import ToolSyntax

log = logging.getLogger("pomona.ingress")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@functools.lru_cache(maxsize=64)
def _machine(think: tuple[str, str] | None, tool: tuple[str, str] | None) -> TextStateMachine:
    """Transitions as mlx-lm's make_text_state_machine builds them, from markers we were given
    (the fallback's and forced parsers' markers are not the tokenizer's)."""
    transitions: dict[str, list[tuple[str, str]]] = {"normal": []}
    if think:
        transitions["normal"].append((think[0], "reasoning"))
        transitions["reasoning"] = [(think[1], "normal")]
    if tool:
        transitions["normal"].append((tool[0], "tool"))
        if think:  # as mlx-lm: a call may open straight from the reasoning
            transitions["reasoning"].append((tool[0], "tool"))
        transitions["tool"] = [(tool[1], "normal")] if tool[1] else []  # mistral: no end marker
    return TextStateMachine(transitions)


class _Section:
    """One tool section in progress."""

    def __init__(self, json_body: bool) -> None:
        self.scanner = CallScanner() if json_body else None
        self.raw = ""
        self.index: int | None = None  # set once its ToolCallStart went out
        self.id = ""
        self.name = ""
        self.streamed = ""


def _normalise(parsed: dict | list) -> list[tuple[str, str, str | None]] | None:
    """(name, arguments JSON text, parser's id) per call, or None when it is not a call."""
    calls = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(call, dict):
            return None
        name, args = call.get("name"), call.get("arguments")
        if isinstance(args, str):  # some formats carry the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(name, str) or not name or not isinstance(args, (dict, type(None))):
            return None
        call_id = call.get("id")
        calls.append((name, json.dumps(args or {}, ensure_ascii=False), call_id if isinstance(call_id, str) else None))
    return calls or None


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


class OutputParser:
    """One choice's text in, `OutputEvent`s out: `feed` each streamed piece, then `finish` once.

    `tools`: the request's tools as OpenAI function dicts (mlx-lm's parsers read their schemas).
    `tools_enabled` False (tool_choice "none", or no tools): call markers are plain content.
    `starts_in_reasoning`: the prompt ended inside an open think section. `max_calls`: see the module
    docstring (None: no bound).
    """

    def __init__(self, syntax: ToolSyntax, tools: Sequence[dict[str, Any]] | None = None, *,
                 think_start: str | None = None, think_end: str | None = None, reasoning_inline: bool = False,
                 tools_enabled: bool = True, starts_in_reasoning: bool = False,
                 max_calls: int | None = None) -> None:
        self._max_calls = max_calls
        think = (think_start, think_end) if think_start and think_end and not reasoning_inline else None
        self._syntax, self._tools = syntax, list(tools or []) or None
        self._tools_on = tools_enabled
        machine = _machine(think, (syntax.start, syntax.end) if tools_enabled else None)
        self._sm = machine.make_state("reasoning" if think and starts_in_reasoning else "normal")
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[ToolCall] = []
        self._invalid: list[int] = []
        self._dropped = 0
        self._section: _Section | None = None
        self._ws = ""  # whitespace-only content held back: dropped if a call comes next
        self._ws_before = ""  # what was held when the current section began
        self._after_call = False

    # ------------------------------------------------------------------------------- the stream

    def feed(self, text: str) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        if not text:
            return events
        self._sm, segments = TextStateMachine.split(self._sm, text)
        for i, (state, chunk) in enumerate(segments):
            if i > 0 and state == "tool":  # a start marker was matched
                self._ws_before, self._ws = self._ws, ""
                self._section = _Section(self._syntax.json_body)
            self._add(state, chunk, events)
            if i < len(segments) - 1 and state == "tool":  # its end marker was matched
                self._close(events, terminated=True)
        return events

    def finish(self, reason: str) -> list[OutputEvent]:
        """Flush held text (a marker's beginning that never completed is text of its state) and
        parse an unterminated section as it is, whatever the engine's `reason`: mistral's calls have
        no end marker, and a call cut by "length" is handled as the module docstring says."""
        events: list[OutputEvent] = []
        self._sm, rest, state = TextStateMachine.flush(self._sm)
        if rest:
            self._add(state, rest, events)
        if self._section is not None:
            self._close(events, terminated=False)
        if self._ws and not self._after_call:
            self._emit_text(self._ws, events)
        self._ws = ""
        return events

    def _add(self, state: str | None, chunk: str, events: list[OutputEvent]) -> None:
        if not chunk:
            return
        if state == "reasoning":
            self._reasoning.append(chunk)
            events.append(ReasoningDelta(chunk))
        elif state == "tool" and self._section is not None:
            self._grow(self._section, chunk, events)
        else:
            self._content(chunk, events)

    def _content(self, chunk: str, events: list[OutputEvent]) -> None:
        if not self._tools_on:
            self._emit_text(chunk, events)
            return
        text = self._ws + chunk
        if self._after_call:
            text = text.lstrip()
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            self._after_call = False
            self._emit_text(body, events)

    def _emit_text(self, text: str, events: list[OutputEvent]) -> None:
        self._text.append(text)
        events.append(TextDelta(text))

    # ------------------------------------------------------------------------------- tool calls

    def _grow(self, sec: _Section, chunk: str, events: list[OutputEvent]) -> None:
        sec.raw += chunk
        scan = sec.scanner
        if scan is None:
            return  # parsed whole at its end
        scan.feed(chunk)
        if sec.index is None and scan.name and not self._full:
            self._start(sec, scan.name, new_call_id(), events)
        if sec.index is not None and scan.args_object:
            self._stream_args(sec, scan.args_so_far(len(sec.streamed)), events)

    def _start(self, sec: _Section, name: str, call_id: str, events: list[OutputEvent]) -> None:
        sec.index, sec.id, sec.name = len(self._calls), call_id, name  # one section open at a time
        events.append(ToolCallStart(sec.index, call_id, name))

    def _stream_args(self, sec: _Section, new: str, events: list[OutputEvent]) -> None:
        """Send `new`, the arguments text after what was already sent (slices, not the whole
        value again: a long argument must not cost quadratic copying)."""
        if new:
            assert sec.index is not None
            events.append(ToolArgsDelta(sec.index, new))
            sec.streamed += new

    def _close(self, events: list[OutputEvent], terminated: bool) -> None:
        sec, self._section = self._section, None
        assert sec is not None
        if sec.index is not None:
            self._close_streamed(sec, events)
            return
        if self._full:  # a call past max_calls: left out (the spacing before it goes too)
            self._ws, self._after_call = self._ws_before, True
            return
        calls = self._parse(sec.raw)
        if calls is None:  # not a call: dropped, never content (see the module docstring)
            self._ws, self._after_call = self._ws_before, True  # spacing around it goes too
            self._dropped += 1
            log.warning("dropped a tool call that does not parse (%s, %d chars%s)", self._syntax.name,
                        len(sec.raw), "" if terminated else ", cut off")
            return
        self._emit_calls(calls, events)

    def _close_streamed(self, sec: _Section, events: list[OutputEvent]) -> None:
        """End a call whose start went out. Its arguments are the object text streamed so far
        (complete, or cut short: then not JSON, and listed in invalid_calls); when nothing was
        streamed (arguments not an object, or absent) the parser's reading, sent now whole."""
        assert sec.index is not None
        args = sec.streamed
        if not args:
            parsed = self._parse(sec.raw)
            args = parsed[0][1] if parsed and len(parsed) == 1 else ""
        if not _json_object(args):
            self._invalid.append(sec.index)
        self._stream_args(sec, args[len(sec.streamed):], events)
        call = ToolCall(sec.id, sec.name, args)
        events.append(ToolCallEnd(sec.index, call))
        self._calls.append(call)
        self._after_call = True
        rest = sec.raw[sec.scanner.end:] if sec.scanner and sec.scanner.end is not None else ""
        if rest.strip():  # more calls in the same block (small models do this); other text is ignored
            self._emit_calls(self._parse(rest) or [], events)

    def _emit_calls(self, calls: list[tuple[str, str, str | None]], events: list[OutputEvent]) -> None:
        """Calls parsed whole: each sent as one start, one delta, one end (up to max_calls)."""
        for name, args, call_id in calls:
            if self._full:
                return
            index = len(self._calls)
            call = ToolCall(call_id or new_call_id(), name, args)
            events += [ToolCallStart(index, call.id, name), ToolArgsDelta(index, args), ToolCallEnd(index, call)]
            self._calls.append(call)
            self._after_call = True

    def _parse(self, raw: str) -> list[tuple[str, str, str | None]] | None:
        try:
            return _normalise(self._syntax.parse(raw, self._tools))
        except Exception:  # noqa: BLE001 - mlx-lm's parsers raise ValueError, KeyError, SyntaxError...
            return None

    @property
    def _full(self) -> bool:
        return self._max_calls is not None and len(self._calls) >= self._max_calls

    # ------------------------------------------------------------------------------- results

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        return tuple(self._calls)

    @property
    def invalid_calls(self) -> tuple[int, ...]:
        """Indices of calls whose arguments are not a JSON object (cut off after their start)."""
        return tuple(self._invalid)

    @property
    def dropped_calls(self) -> int:
        """Call sections that did not parse and were dropped."""
        return self._dropped

    def finish_reason(self, engine_reason: str) -> str:
        """"length" when max_tokens cut the answer, "tool_calls" when a call was parsed, else "stop"."""
        if engine_reason == "length":
            return "length"
        return "tool_calls" if len(self._calls) > len(self._invalid) else "stop"
