"""The agent-session benchmark's report: the per-turn table, the Pomona / mlx_lm.server ratios and
goals, and its section of docs/benchmarks.md. Pure functions of the run's results dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from benchmarks.harness.goals import Goal, goals_table
from benchmarks.harness.report import markdown_table

OURS, PEER = "pomona", "mlx_lm.server"
TTFT_TARGET, SESSION_TARGET = "<= 0.5", "<= 0.6"
SECTION = "agent-session"


def _turns(data: Mapping[str, Any], server: str) -> dict[int, Mapping[str, Any]]:
    """A server's successful turns by number (empty when it was skipped or failed)."""
    return {t["turn"]: t for t in (data["servers"].get(server) or {}).get("turns", []) if t["ok"]}


def _complete(data: Mapping[str, Any], server: str) -> bool:
    """Every turn of the trace answered: only then is the session time comparable."""
    return len(_turns(data, server)) == len(data["expected_prompt_tokens"])


def cached_share(turn: Mapping[str, Any]) -> float | None:
    """Cached tokens / prompt tokens as the server reported them; None when it reports neither."""
    prompt, cached = turn.get("prompt_tokens"), turn.get("cached_tokens")
    if not prompt or cached is None:
        return None
    return cached / prompt


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ttft_ratios(data: Mapping[str, Any]) -> dict[int, float | None]:
    """Pomona / mlx_lm.server TTFT for every turn after the first (the turns with a prefix to reuse)."""
    ours, peer = _turns(data, OURS), _turns(data, PEER)
    n = len(data["expected_prompt_tokens"])
    return {k: _ratio(ours[k]["ttft_s"] if k in ours else None, peer[k]["ttft_s"] if k in peer else None)
            for k in range(2, n + 1)}


def session_ratio(data: Mapping[str, Any]) -> float | None:
    if not (_complete(data, OURS) and _complete(data, PEER)):
        return None
    return _ratio(data["servers"][OURS]["session_s"], data["servers"][PEER]["session_s"])


def goals(data: Mapping[str, Any]) -> list[Goal]:
    ours, peer = _turns(data, OURS), _turns(data, PEER)

    def ms(turns: Mapping[int, Mapping[str, Any]], k: int) -> str:
        return f"{turns[k]['ttft_s'] * 1000:.0f} ms" if k in turns else "n/a"
    out = [Goal(f"TTFT turn {k}: Pomona / mlx_lm.server", r, TTFT_TARGET, f"{ms(ours, k)} vs {ms(peer, k)}")
           for k, r in ttft_ratios(data).items()]
    sessions = [(data["servers"].get(s) or {}).get("session_s") for s in (OURS, PEER)]
    detail = " vs ".join("n/a" if s is None else f"{s:.1f} s" for s in sessions)
    out.append(Goal("session time: Pomona / mlx_lm.server", session_ratio(data), SESSION_TARGET, detail))
    return out


def token_mismatches(data: Mapping[str, Any]) -> list[str]:
    """Turns whose reported prompt size differs from the local count of the same prompt."""
    expected = data["expected_prompt_tokens"]
    out = []
    for server in data["servers"]:
        for k, t in _turns(data, server).items():
            if t.get("prompt_tokens") is not None and t["prompt_tokens"] != expected[k - 1]:
                out.append(f"{server} turn {k}: reported {t['prompt_tokens']}, expected {expected[k - 1]}")
    return out


def turn_table(data: Mapping[str, Any]) -> str:
    ours, peer = _turns(data, OURS), _turns(data, PEER)
    ratios = ttft_ratios(data)
    header = ["turn", "prompt tokens", "Pomona TTFT ms", "mlx_lm.server TTFT ms", "TTFT ratio",
              "Pomona e2e ms", "mlx_lm.server e2e ms", "Pomona cached", "mlx_lm.server cached",
              "reported prompt (Pomona / mlx_lm)", "out tokens (Pomona / mlx_lm)"]

    def get(turns: Mapping[int, Mapping[str, Any]], k: int, key: str, scale: float | None = None) -> Any:
        value = turns[k].get(key) if k in turns else None
        return value * scale if value is not None and scale is not None else value

    def share(turns: Mapping[int, Mapping[str, Any]], k: int) -> str:
        s = cached_share(turns[k]) if k in turns else None
        return "n/a" if s is None else f"{s:.0%}"
    rows = []
    for k, expected in enumerate(data["expected_prompt_tokens"], start=1):
        r = ratios.get(k)
        rows.append([k, expected, get(ours, k, "ttft_s", 1000), get(peer, k, "ttft_s", 1000),
                     None if r is None else f"{r:.2f}", get(ours, k, "e2e_s", 1000), get(peer, k, "e2e_s", 1000),
                     share(ours, k), share(peer, k),
                     f"{get(ours, k, 'prompt_tokens')} / {get(peer, k, 'prompt_tokens')}",
                     f"{get(ours, k, 'output_tokens')} / {get(peer, k, 'output_tokens')}"])
    return markdown_table(header, rows)


def _problems(data: Mapping[str, Any]) -> list[str]:
    notes = [f"{k}: {v.get('skipped') or v.get('failed')}" for k, v in data["servers"].items()
             if "skipped" in v or "failed" in v]
    for k, v in data["servers"].items():
        notes += [f"{k} turn {t['turn']} failed: {t['error']}" for t in v.get("turns", []) if not t["ok"]]
        if v.get("interrupted"):
            notes.append(f"{k}: interrupted after {len(v.get('turns', []))} turns (a time limit)")
    return notes + [f"prompt size mismatch: {m}" for m in token_mismatches(data)]


def print_report(data: Mapping[str, Any]) -> None:
    print(turn_table(data))
    for g in goals(data):
        verdict = {True: "met", False: "NOT met", None: "not measured"}[g.met]
        ratio = "n/a" if g.ratio is None else f"{g.ratio:.2f}"
        print(f"{g.name}: {ratio} (goal {g.target}: {verdict}; {g.detail})")
    for line in _problems(data):
        print(f"note: {line}")


def section_text(data: Mapping[str, Any], commit: str, notes: Sequence[str] = ()) -> str:
    """The docs section of one run: command, commit, goals, per-turn table, notes."""
    servers = data["servers"]
    commands = "\n".join(v["command"] for v in servers.values() if "command" in v)
    loads = [f"{k}: 1-minute load average {v['loadavg_1m_before']:.1f} before its run, "
             f"{v['loadavg_1m_after']:.1f} after" for k, v in servers.items() if "loadavg_1m_before" in v]
    routes = ", ".join(f"{k} over {'/v1/messages' if v.get('api') == 'messages' else '/v1/chat/completions'}"
                       for k, v in servers.items() if "api" in v)
    all_notes = [*_problems(data), *loads, *notes]
    return f"""## Agent session: Pomona /v1/messages vs mlx_lm.server (issue 18)

Generated by `benchmarks/agent/agent_session.py` (this section only; rerun it to replace it).
Commit {commit}; `{data['command']}`; model `{data['model_dir']}`; {routes}.

A fixed coding-agent trace (`benchmarks/agent/agent_trace.py`): a system prompt of instructions and 16 tools
with JSON schemas (~3.8k tokens), then turns of the assistant's tool call (from the trace, not the
model, so both servers see the same prompts) and a 200-800-token tool result; each turn asks for
{data['max_tokens']} tokens, greedy, held at that length (`ignore_eos` / an EOS logit bias). Pomona gets
Anthropic's shape (`tools`, `tool_use` and `tool_result` blocks); mlx_lm.server gets the same
conversation as chat messages in the text Pomona renders for SmolLM2's template, which has no tools
section (tool list in the system prompt, `<tool_call>` / `<tool_response>` blocks), so the prompts are
token for token the same ("prompt tokens" is the local count; each server's own count is shown too).
TTFT: send to the first streamed output event (Anthropic `content_block_delta`, OpenAI delta content),
on the client. Session: {session_text(data)}. Cached: the share of the prompt the server reports
from its prefix cache (`cache_read_input_tokens`; `cached_tokens`).

{goals_table(goals(data))}

{turn_table(data)}

Servers started ({started_text(data)}):
```
{commands}
```
{chr(10).join(f"- {n}" for n in all_notes) or "- no notes"}
"""


def session_text(data: Mapping[str, Any]) -> str:
    if data.get("order") == "interleaved":
        return ("the sum of a server's turns; both servers were up and each turn went to one, then the "
                "other (the first server alternating), so a drift of the box's speed falls on both")
    return "first send to last turn's end, turns back to back"


def started_text(data: Mapping[str, Any]) -> str:
    return "both at once, turns interleaved" if data.get("order") == "interleaved" else "one at a time, each fresh"


def write_docs(path: Path, data: Mapping[str, Any], notes: Sequence[str] = ()) -> Path:
    from benchmarks.harness.docs import replace_section, versions

    commit = data.get("commit") or versions()["pomona commit"]  # the commit measured, recorded at the start
    replace_section(path, SECTION, section_text(data, commit, list(notes)))
    return path
