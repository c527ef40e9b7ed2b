"""The agent-session benchmark without servers: its trace (sizes, determinism, identical prompts for
both servers) and its report maths. The trace is measured in the default model's real tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.agent import agent_report as rep
from benchmarks.agent.agent_session import StreamState, anthropic_event, anthropic_prompt_tokens, expected_prompt_tokens
from benchmarks.agent.agent_trace import anthropic_body, build_trace, chat_messages
from benchmarks.harness.docs import kept_sections, replace_section

CONTEXT, MAX_TOKENS = 8192, 32


@pytest.fixture(scope="module")
def default_tok() -> Any:
    from modelio.models import resolve_model
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model("default")))


@pytest.fixture(scope="module")
def trace(default_tok: Any) -> Any:
    return build_trace(lambda text: len(default_tok.encode(text, add_special_tokens=False)))


def _count(tok: Any, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


@pytest.mark.real_model
def test_trace_sizes_fit_the_issue_and_the_context(default_tok: Any, trace: Any) -> None:
    system = chat_messages(trace, 1)[0]["content"]
    assert 3500 <= _count(default_tok, system) <= 4500
    assert 12 <= len(trace.tools) <= 20 and trace.turns == 10
    assert all(200 <= _count(default_tok, s.result) <= 800 for s in trace.steps)
    prompts = expected_prompt_tokens(default_tok, trace)
    assert all(a < b for a, b in zip(prompts, prompts[1:]))  # each turn extends the previous one
    assert prompts[-1] + MAX_TOKENS <= CONTEXT


@pytest.mark.real_model
def test_trace_is_deterministic_and_seeded(default_tok: Any, trace: Any) -> None:
    count = lambda text: _count(default_tok, text)  # noqa: E731
    assert build_trace(count) == trace
    other = build_trace(count, seed=1)
    assert [s.result for s in other.steps] != [s.result for s in trace.steps]
    assert len(build_trace(count, turns=3).steps) == 3
    with pytest.raises(ValueError):
        build_trace(count, turns=11)


@pytest.mark.real_model
def test_both_servers_get_the_same_prompt(trace: Any) -> None:
    """The chat messages for mlx_lm.server render, through the model's template, to exactly the
    prompt Pomona builds from the Anthropic request (its own parser and renderer)."""
    from modelio.models import resolve_model
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from api.core import fields as oa
    from api.anthropic.request import parse_messages_request
    from api.output.tool_syntax import render_prompt, syntax_for

    tok = load_tokenizer(resolve_model("default"))
    for turn in (1, 4, 10):
        conv = parse_messages_request(anthropic_body(trace, turn, "m", MAX_TOKENS), oa.Limits(), 4096)
        pomona = render_prompt(tok, conv.messages, conv.tools, syntax_for(tok), {})
        peer = tok.apply_chat_template(chat_messages(trace, turn), add_generation_prompt=True, tokenize=False)
        assert pomona == peer
        assert trace.steps[turn - 1].result in pomona and "read_file" in pomona


def test_anthropic_body_pairs_each_call_with_its_result(trace: Any) -> None:
    body = anthropic_body(trace, 5, "m", MAX_TOKENS, {"ignore_eos": True})
    uses = [b["id"] for m in body["messages"] if m["role"] == "assistant" for b in m["content"]
            if b["type"] == "tool_use"]
    results = [b["tool_use_id"] for m in body["messages"] if m["role"] == "user" and isinstance(m["content"], list)
               for b in m["content"]]
    assert uses == results == [s.call_id for s in trace.steps[:5]] and len(set(uses)) == 5
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == MAX_TOKENS
    assert {t["name"] for t in body["tools"]} == {t.name for t in trace.tools}


def test_anthropic_stream_events_time_the_first_output() -> None:
    state, usage = StreamState(t0=0.0), {}
    events = [{"type": "message_start", "message": {"usage": {"input_tokens": 40, "cache_read_input_tokens": 4000}}},
              {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
              {"type": "ping"}]
    assert not any(anthropic_event(e, state, usage) for e in events)
    assert state.first is None  # an empty text block's start is not output
    anthropic_event({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
                    state, usage)
    first = state.first
    anthropic_event({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "!"}},
                    state, usage)
    anthropic_event({"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 2}},
                    state, usage)
    assert anthropic_event({"type": "message_stop"}, state, usage)
    assert (state.first, state.first_event, state.text) == (first, "text_delta", "Hi!") and first is not None
    assert anthropic_prompt_tokens(usage) == 4040 and usage["output_tokens"] == 2
    tool_state = StreamState(t0=0.0)
    anthropic_event({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "t"}},
                    tool_state, {})
    assert tool_state.first_event == "tool_use"
    with pytest.raises(RuntimeError, match="overloaded"):
        anthropic_event({"type": "error", "error": {"type": "overloaded_error"}}, StreamState(0.0), {})


def _turn(k: int, ttft: float, prompt: int | None = None, cached: int | None = None, ok: bool = True) -> dict:
    return {"turn": k, "ok": ok, "ttft_s": ttft, "e2e_s": ttft + 1.0, "output_tokens": 32,
            "prompt_tokens": prompt, "cached_tokens": cached, "error": None if ok else "boom"}


def _data(ours: list[dict], peer: list[dict], sessions: tuple[float, float] = (10.0, 20.0)) -> dict:
    return {"command": "python -m benchmarks.agent.agent_session", "model_dir": "/m", "max_tokens": 32,
            "expected_prompt_tokens": [100, 200, 300],
            "servers": {"pomona": {"turns": ours, "session_s": sessions[0], "api": "messages", "command": "serve"},
                        "mlx_lm.server": {"turns": peer, "session_s": sessions[1], "api": "chat", "command": "mlx"}}}


def test_report_ratios_and_goals() -> None:
    data = _data([_turn(1, 4.0, 100, 0), _turn(2, 0.5, 200, 100), _turn(3, 0.9, 300, 200)],
                 [_turn(1, 5.0, 100, 0), _turn(2, 2.0, 200, 100), _turn(3, 1.5, 301, None)])
    assert rep.ttft_ratios(data) == {2: 0.25, 3: pytest.approx(0.6)}
    assert rep.session_ratio(data) == 0.5
    met = {g.name: g.met for g in rep.goals(data)}
    assert met == {"TTFT turn 2: Pomona / mlx_lm.server": True, "TTFT turn 3: Pomona / mlx_lm.server": False,
                   "session time: Pomona / mlx_lm.server": True}
    assert rep.cached_share(data["servers"]["pomona"]["turns"][2]) == pytest.approx(2 / 3)
    assert rep.cached_share(data["servers"]["mlx_lm.server"]["turns"][2]) is None
    assert rep.token_mismatches(data) == ["mlx_lm.server turn 3: reported 301, expected 300"]
    table = rep.turn_table(data)
    assert "| 2 | 200 | 500.0 | 2000.0 | 0.25 |" in table and "| 67% | n/a |" in table


def test_report_with_a_failed_turn_compares_no_session() -> None:
    data = _data([_turn(1, 4.0), _turn(2, 0.5), _turn(3, 0.0, ok=False)], [_turn(1, 5.0), _turn(2, 2.0), _turn(3, 1.5)])
    assert rep.ttft_ratios(data) == {2: 0.25, 3: None}
    assert rep.session_ratio(data) is None
    assert "pomona turn 3 failed: boom" in rep.section_text(data, "abc1234")


def test_docs_section_is_replaced_and_kept(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nside by side\n")
    replace_section(page, "agent-session", "## Agent\nfirst run\n")
    replace_section(page, "agent-session", "## Agent\nsecond run\n")
    text = page.read_text()
    assert text.startswith("# Benchmarks\n\nside by side\n") and text.count("## Agent") == 1
    assert "second run" in text and "first run" not in text
    assert kept_sections("# regenerated\n" + text) == "\n" + text[text.index("<!-- section:"):]


def test_serving_path_splits_a_turn_by_the_servers_own_sums() -> None:
    from benchmarks.agent.serving_path import ENGINE_TTFT, INGRESS_TTFT, metric_sums, split

    text = ("# TYPE pomona_time_to_first_token_seconds histogram\n"
            'pomona_time_to_first_token_seconds_sum{route="a"} 1.5\n'
            'pomona_time_to_first_token_seconds_sum{route="b"} 0.5\n'
            "# TYPE pomona_engine_ttft_seconds_sum gauge\npomona_engine_ttft_seconds_sum 1.25\n")
    after = metric_sums(text, (ENGINE_TTFT, INGRESS_TTFT))
    assert after == {ENGINE_TTFT: 1.25, INGRESS_TTFT: 2.0}
    row = split(0.9, {ENGINE_TTFT: 1.0, INGRESS_TTFT: 1.2}, after)
    assert row == pytest.approx({"client_ms": 900.0, "engine_ms": 250.0, "hops_ms": 550.0, "front_ms": 100.0})
