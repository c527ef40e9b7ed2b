"""The fixed agent session that benchmarks/agent/agent_session.py replays: the system prompt and tools of
benchmarks/agent/agent_tools.py, a user task, then steps of (the assistant's tool call, its result).

Deterministic: results are synthetic file contents, grep output and command output made from a
seeded random.Random and sized in tokens of the given tokenizer. The assistant's calls come from
the trace, never from the model, so every server sees the same prompts whatever it generates.

Turn k's request is the system prompt, the task and steps 1..k, and asks for a short answer.
Two renderings of one turn:
- `anthropic_body`: what an agent client sends to /v1/messages (system, tools with input_schema,
  assistant `tool_use` blocks, user `tool_result` blocks).
- `chat_messages`: the same conversation as plain chat messages in the form Pomona's generic tool
  fallback renders for a template without tools (api/output/tool_syntax.py: tool list appended to
  the system text, calls as `<tool_call>` blocks in the assistant's content, results as
  `<tool_response>` user messages). For mlx_lm.server: SmolLM2's template has no tools section, so
  `tools`, `tool_calls` and `role: "tool"` sent there would drop the tool list (it only warns) and
  the prompts would no longer be the same size.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from benchmarks.agent.agent_tools import INSTRUCTIONS, TOOLS
from api.core.conversation import Tool, ToolCall
from api.output.tool_syntax import fallback_call_text, fallback_system_text

TASK = ("The scheduler retries failed jobs too fast: when the database is down, the worker pool hammers it. "
        "Find where retries are scheduled, add exponential backoff with a cap (use the existing config "
        "system), and make sure the tests pass.")
# Tool-result sizes in tokens, turn by turn (at least these, under one line more): 200-800 as an agent sees, summing to what fits the
# default model's 8,192-token context after a ~3.8k system prompt and ten turns.
RESULT_TOKENS = (420, 250, 770, 220, 200, 300, 340, 270, 230, 200)


@dataclass(frozen=True)
class Step:
    """One assistant turn of the trace (a line of text, one tool call) and the tool's result."""

    call_id: str
    text: str
    name: str
    input: dict[str, Any]
    result: str


@dataclass(frozen=True)
class AgentTrace:
    instructions: str
    tools: tuple[Tool, ...]
    task: str
    steps: tuple[Step, ...]

    @property
    def turns(self) -> int:
        return len(self.steps)


def _words(rng: random.Random, n: int) -> str:
    return "_".join(rng.choice(_NAMES) for _ in range(n))


_NAMES = ("job", "retry", "queue", "worker", "pool", "delay", "config", "state", "batch", "lease", "clock",
          "attempt", "backoff", "limit", "task", "store", "event", "timer", "shard", "window", "budget")


def _python_lines(rng: random.Random) -> Callable[[int], str]:
    def line(i: int) -> str:
        kind = rng.random()
        name = _words(rng, 2)
        if kind < 0.12:
            body = f"def {name}(self, {_words(rng, 1)}: int, *, {_words(rng, 2)}: float = {rng.randint(1, 9)}.0) -> bool:"
        elif kind < 0.2:
            body = f'    """Return the {_words(rng, 1)} for the next {_words(rng, 1)}, or None when idle."""'
        elif kind < 0.45:
            body = f"        {name} = self.{_words(rng, 1)}.get({_words(rng, 1)!r}, {rng.randint(0, 500)})"
        elif kind < 0.6:
            body = f"        if {name} > self.{_words(rng, 2)}:"
        elif kind < 0.75:
            body = f"            log.debug(\"{name} %s after %d ms\", job.id, {rng.randint(10, 9000)})"
        else:
            body = f"        return self._{_words(rng, 2)}({name}, now=self.clock.monotonic())"
        return f"{i:6d}\t{body}"
    return line


def _grep_lines(rng: random.Random) -> Callable[[int], str]:
    files = [f"src/orchard/{_words(rng, 1)}.py" for _ in range(6)] + ["tests/test_scheduler.py"]

    def line(i: int) -> str:
        return (f"{rng.choice(files)}:{rng.randint(12, 480)}:        {_words(rng, 2)} = "
                f"self.config.retry_{_words(rng, 1)} * attempt")
    return line


def _pytest_lines(rng: random.Random) -> Callable[[int], str]:
    def line(i: int) -> str:
        status = rng.choices(["PASSED", "FAILED", "PASSED", "PASSED", "SKIPPED"])[0]
        return (f"tests/test_{_words(rng, 1)}.py::test_{_words(rng, 3)} {status}"
                f"{' ' * rng.randint(1, 8)}[{min(99, i * 2)}%]")
    return line


def _yaml_lines(rng: random.Random) -> Callable[[int], str]:
    def line(i: int) -> str:
        if i % 7 == 1:
            return f"{_words(rng, 1)}:"
        return f"  {_words(rng, 2)}: {rng.choice([str(rng.randint(1, 3600)), 'true', 'false', repr(_words(rng, 1))])}"
    return line


def _paths_lines(rng: random.Random) -> Callable[[int], str]:
    def line(i: int) -> str:
        return f"/home/dev/projects/orchard/{rng.choice(['src/orchard', 'tests', 'docs'])}/{_words(rng, 2)}.py"
    return line


def _diff_lines(rng: random.Random) -> Callable[[int], str]:
    def line(i: int) -> str:
        if i % 12 == 1:
            return f"@@ -{rng.randint(10, 300)},7 +{rng.randint(10, 300)},9 @@ class {_words(rng, 1).title()}Scheduler:"
        sign = rng.choice([" ", " ", "+", "-"])
        return f"{sign}        {_words(rng, 2)} = min(self.config.{_words(rng, 2)}, {rng.randint(1, 60)} * 2 ** attempt)"
    return line


def _docs_lines(rng: random.Random) -> Callable[[int], str]:
    def line(i: int) -> str:
        if i % 6 == 1:
            return f"## {_words(rng, 2).replace('_', ' ').title()}"
        return (f"The `{_words(rng, 2)}` setting controls how long the {_words(rng, 1)} waits before the next "
                f"{_words(rng, 1)}; it defaults to {rng.randint(1, 120)} seconds.")
    return line


# (tool name, input, line maker, assistant text) per step: a plausible debugging session.
_PLAN: tuple[tuple[str, dict[str, Any], Callable[[random.Random], Callable[[int], str]], str], ...] = (
    ("grep", {"pattern": "retry|backoff", "path": "src", "output_mode": "content"}, _grep_lines,
     "I'll start by finding where retries are scheduled."),
    ("read_file", {"file_path": "/home/dev/projects/orchard/src/orchard/scheduler.py", "limit": 120},
     _python_lines, "The retry delay is computed in the scheduler; let me read it."),
    ("read_file", {"file_path": "/home/dev/projects/orchard/src/orchard/scheduler.py", "offset": 120},
     _python_lines, "The rest of the scheduler, where the delay is applied:"),
    ("read_file", {"file_path": "/home/dev/projects/orchard/config/defaults.yaml"}, _yaml_lines,
     "Now the config system, to add the backoff settings there."),
    ("glob", {"pattern": "tests/**/test_*.py"}, _paths_lines, "Let me find the scheduler's tests."),
    ("edit_file", {"file_path": "/home/dev/projects/orchard/src/orchard/scheduler.py",
                   "old_string": "delay = self.config.retry_delay * attempt",
                   "new_string": "delay = min(self.config.retry_max_delay, self.config.retry_delay * 2 ** attempt)"},
     _python_lines, "I'll replace the linear delay with a capped exponential one."),
    ("bash", {"command": "python -m pytest tests/test_scheduler.py -q", "description": "Run the scheduler tests"},
     _pytest_lines, "Running the scheduler tests:"),
    ("bash", {"command": "git diff", "description": "Show the changes so far"}, _diff_lines,
     "One test expects the old delay; let me check the diff before fixing it."),
    ("web_fetch", {"url": "https://docs.orchard.dev/config/retries", "prompt": "What are the retry settings?"},
     _docs_lines, "Let me check the documented retry settings so the names match."),
    ("bash", {"command": "python -m pytest -q", "description": "Run the whole test suite"}, _pytest_lines,
     "Running the whole suite after the fix:"),
)


def _sized_text(make_line: Callable[[int], str], n_tokens: int, count: Callable[[str], int]) -> str:
    """Whole lines until the text has at least `n_tokens` (so it overshoots by under one line)."""
    lines = [make_line(1)]
    while count("\n".join(lines)) < n_tokens:
        lines.append(make_line(len(lines) + 1))
    return "\n".join(lines)


def build_trace(count: Callable[[str], int], turns: int = 10, seed: int = 0,
                result_tokens: Sequence[int] = RESULT_TOKENS) -> AgentTrace:
    """The session of `turns` steps; `count(text)` is the model's token count of a text."""
    if not 1 <= turns <= len(_PLAN):
        raise ValueError(f"turns must be 1..{len(_PLAN)}, got {turns}")
    rng = random.Random(seed)
    steps = []
    for k, (name, args, lines, text) in enumerate(_PLAN[:turns]):
        result = _sized_text(lines(rng), result_tokens[k], count)
        steps.append(Step(f"toolu_{seed:02d}{k + 1:02d}{rng.getrandbits(40):010x}", text, name, args, result))
    tools = tuple(Tool(name, description, schema) for name, description, schema in TOOLS)
    return AgentTrace(INSTRUCTIONS, tools, TASK, tuple(steps))


def _check_turn(trace: AgentTrace, turn: int) -> None:
    if not 1 <= turn <= trace.turns:
        raise ValueError(f"turn must be 1..{trace.turns}, got {turn}")


def anthropic_body(trace: AgentTrace, turn: int, model: str, max_tokens: int,
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Turn `turn` (1-based) as a streaming /v1/messages request."""
    _check_turn(trace, turn)
    messages: list[dict[str, Any]] = [{"role": "user", "content": trace.task}]
    for step in trace.steps[:turn]:
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": step.text},
            {"type": "tool_use", "id": step.call_id, "name": step.name, "input": step.input}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": step.call_id, "content": step.result}]})
    tools = [{"name": t.name, "description": t.description, "input_schema": t.parameters} for t in trace.tools]
    return {"model": model, "max_tokens": max_tokens, "system": trace.instructions, "tools": tools,
            "messages": messages, "temperature": 0.0, "stream": True, **(extra or {})}


def chat_messages(trace: AgentTrace, turn: int) -> list[dict[str, str]]:
    """Turn `turn` (1-based) as plain chat messages (see the module docstring)."""
    _check_turn(trace, turn)
    system = f"{trace.instructions}\n\n{fallback_system_text(trace.tools)}"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": trace.task}]
    for step in trace.steps[:turn]:
        call = ToolCall(step.call_id, step.name, json.dumps(step.input))
        messages.append({"role": "assistant", "content": f"{step.text}\n{fallback_call_text(call)}"})
        messages.append({"role": "user", "content": f"<tool_response>\n{step.result}\n</tool_response>"})
    return messages
