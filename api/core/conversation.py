"""One request model and one output model for the dialects (OpenAI chat and text completions,
Anthropic Messages, OpenAI Responses). No HTTP, no Ray, no model.

Each dialect's route module parses its body into a `Conversation` (or, for text completions, a
`TextPrompt`: a prompt the chat template never sees), hands it to the shared generation pipeline
(`api.core.generation`), and renders the `OutputEvent`s and the final `Completion` in its own
shape. A fix to tool parsing or to the grammar therefore reaches every chat dialect at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from engine.types import SamplingParams

Role = Literal["system", "user", "assistant", "tool"]
ToolChoiceMode = Literal["auto", "none", "required", "named"]
FormatKind = Literal["text", "json_object", "json_schema"]
Finish = Literal["stop", "length", "tool_calls"]


@dataclass(frozen=True)
class ToolCall:
    """A call the assistant made: `arguments` is JSON text (an object), as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def arguments_object(self) -> Any:
        return json.loads(self.arguments) if self.arguments.strip() else {}


@dataclass(frozen=True)
class Message:
    """A message after parsing, in the role vocabulary chat templates know.

    `tool_call_id` / `name` are set on `role="tool"` results; `tool_calls` on assistant turns that
    called tools (their `content` may be empty); `reasoning` is reasoning passed back by the client.
    """

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None


@dataclass(frozen=True)
class Tool:
    """A function tool; `parameters` is its JSON schema (an object schema)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = False

    def schema_json(self) -> str:
        return json.dumps(self.parameters, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolChoiceMode = "auto"
    name: str | None = None  # with mode "named"


@dataclass(frozen=True)
class OutputFormat:
    """What the answer (after any reasoning) must be: free text, any JSON object, or a schema."""

    kind: FormatKind = "text"
    schema: dict[str, Any] | None = None
    name: str | None = None


@dataclass(frozen=True)
class Conversation:
    """A validated chat-style request, whichever dialect it came in.

    `max_tokens` None means the server's default bounded by the room left in the context; with
    `max_tokens_cap` a max_tokens that does not fit beside the prompt becomes the room left (agent
    clients size Anthropic's required max_tokens for Claude's context) instead of a 400.
    `parallel_tool_calls` False: at most one call in the answer, whatever `tool_choice` is
    (api.core.generation ends the generation when the first call closes).
    `param_prefix` names where the dialect keeps fields, so errors found later (a bad schema)
    point at the client's own field names (e.g. "response_format" or "output_config.format").
    """

    model: str
    messages: tuple[Message, ...]
    sampling: SamplingParams  # its max_tokens is a placeholder until the prompt length is known
    max_tokens: int | None = None
    max_tokens_cap: bool = False
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True
    output_format: OutputFormat = OutputFormat()
    reasoning_inline: bool = False  # keep reasoning in the text instead of splitting it out
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()
    stream: bool = False
    n: int = 1
    include_usage: bool = False  # OpenAI's stream_options.include_usage
    logprobs: bool = False
    format_param: str = "response_format"  # the client's name for output_format, for error messages
    tools_param: str = "tools"
    cache_salt: str = ""  # the request's own prefix-cache partition (vLLM's `cache_salt`); "" none



@dataclass(frozen=True)
class TextPrompt:
    """A validated text-completion request (OpenAI's `/v1/completions`): the prompt goes to the model
    as it is, text or token ids, with no chat template, no tools, no grammar and no output parsing.

    It travels the same route body as a `Conversation` (as mlx-lm's one `CompletionRequest` serves
    chat and text alike); `n` is always 1. `max_tokens` None means the server's default, bounded by
    the room left in the context.
    """

    model: str
    sampling: SamplingParams  # its max_tokens is a placeholder until the prompt length is known
    prompt: str | tuple[int, ...] = ""
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    user: str | None = None
    cache_salt: str = ""  # the request's own prefix-cache partition (vLLM's `cache_salt`); "" none
    n: int = 1


# ---------------------------------------------------------------------------------------------- output


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A call began: its id is Pomona's, its name is known (arguments follow)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolArgsDelta:
    """A piece of the call's arguments JSON text, in generation order; the pieces concatenate to
    `ToolCallEnd.call.arguments`."""

    index: int
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    call: ToolCall


OutputEvent = Union[TextDelta, ReasoningDelta, ToolCallStart, ToolArgsDelta, ToolCallEnd]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Completion:
    """One finished choice: what every dialect's whole (non-streamed) answer is built from.

    `finish` is "tool_calls" when the answer ends in calls; `stop_sequence` is the stop string that
    ended it, if one did.
    """

    text: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]
    finish: Finish
    usage: Usage
    stop_sequence: str | None = None
    logprobs: tuple[dict[str, Any], ...] = ()
