"""Agent-session benchmark (issue 18): a scripted coding-agent session replayed through Pomona's
`POST /v1/messages` and, for the peer, mlx_lm.server's `/v1/chat/completions`, on the same model.

    python -m benchmarks.agent.agent_session            # 10 turns on each server, docs/benchmarks.md section
    python -m benchmarks.agent.agent_session --quick    # 3 turns, no docs (a smoke run)
    python -m benchmarks.agent.agent_session --from-results benchmarks/results/agent-.../results.json  # re-render

The trace (benchmarks/agent/agent_trace.py) is fixed: a ~3.8k-token system prompt with 16 tools, then turns
of (the assistant's tool call from the trace, a 200-800-token tool result), each asking for a short
answer (greedy, `max_tokens` 32, held at that length by `ignore_eos` / an EOS logit bias, as in
benchmarks/harness/side_by_side.py). Both servers see prompts of the same tokens; the local count and each
server's reported count are printed per turn. By default both servers are up and each turn goes to
one, then the other (`--order interleaved`): the box's speed drifts by tens of percent from one
minute to the next, and interleaving puts that drift on both; `--order sequential` runs one whole
session after the other.

TTFT is client-side: from sending the request to the first streamed event that carries generated
output (OpenAI: a chunk with delta content or reasoning; Anthropic: a `content_block_delta`, or the
start of a `tool_use` block). Session time: first send to the last turn's end (turns back to back).
Cached share: `usage.cache_read_input_tokens` / prompt tokens (Pomona), and
`usage.prompt_tokens_details.cached_tokens` / `prompt_tokens` (mlx_lm.server reports it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx

from benchmarks.agent.agent_report import print_report, write_docs
from benchmarks.agent.agent_trace import AgentTrace, anthropic_body, build_trace, chat_messages
from benchmarks.harness.client import EndpointConfig, stream_chat
from benchmarks.harness.docs import versions
from benchmarks.harness.serve_bench import write_json
from benchmarks.harness.servers import available
from benchmarks.harness.side_by_side import make_spec, serving, unavailable

SERVERS = ("pomona", "mlx_lm.server")
QUICK_TURNS = 3


@dataclass(frozen=True)
class TurnResult:
    turn: int  # 1-based
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None  # as the server reported it (None: not reported)
    cached_tokens: int | None = None
    first_event: str = ""  # what carried the first output ("text_delta", "content", ...)
    text: str = ""
    error: str | None = None


def anthropic_prompt_tokens(usage: dict[str, Any]) -> int | None:
    """Prompt tokens from Anthropic usage: `input_tokens` counts only the uncached part there, so the
    prompt is input + cache reads + cache writes."""
    if "input_tokens" not in usage:
        return None
    return sum(int(usage.get(k) or 0) for k in ("input_tokens", "cache_read_input_tokens",
                                                "cache_creation_input_tokens"))


@dataclass
class StreamState:
    t0: float
    first: float | None = None
    first_event: str = ""
    text: str = ""

    def output(self, kind: str, piece: str = "") -> None:
        if self.first is None:
            self.first, self.first_event = time.perf_counter(), kind
        self.text += piece


def anthropic_event(data: dict[str, Any], state: StreamState, usage: dict[str, Any]) -> bool:
    """One Anthropic SSE event; True at `message_stop`."""
    kind = data.get("type")
    if kind == "message_start":
        usage.update((data.get("message") or {}).get("usage") or {})
    elif kind == "content_block_start" and (data.get("content_block") or {}).get("type") == "tool_use":
        state.output("tool_use")
    elif kind == "content_block_delta":
        delta = data.get("delta") or {}
        state.output(delta.get("type", "delta"), delta.get("text") or delta.get("thinking") or
                     delta.get("partial_json") or "")
    elif kind == "message_delta":
        usage.update(data.get("usage") or {})
    elif kind == "error":
        raise RuntimeError(f"stream error: {data.get('error')}")
    return kind == "message_stop"


async def stream_messages(client: httpx.AsyncClient, base_url: str, body: dict[str, Any], turn: int) -> TurnResult:
    """One streaming /v1/messages request, timed like benchmarks.harness.client times chat completions."""
    state, usage = StreamState(time.perf_counter()), {}
    headers = {"anthropic-version": "2023-06-01", "x-api-key": os.environ.get("POMONA_API_KEY", "none")}
    try:
        async with client.stream("POST", f"{base_url}/messages", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"HTTP {resp.status_code}: {detail}")
            async for line in resp.aiter_lines():
                if line.startswith("data:") and anthropic_event(json.loads(line[5:]), state, usage):
                    break
    except Exception as exc:  # noqa: BLE001 - a failed turn is reported, never a crash
        return TurnResult(turn, False, e2e_s=time.perf_counter() - state.t0, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    return TurnResult(turn, True, (state.first or end) - state.t0, end - state.t0, int(usage.get("output_tokens") or 0),
                      anthropic_prompt_tokens(usage), usage.get("cache_read_input_tokens"), state.first_event,
                      state.text)


async def stream_chat_turn(client: httpx.AsyncClient, cfg: EndpointConfig, messages: list[dict[str, str]],
                           max_tokens: int, turn: int) -> TurnResult:
    r = await stream_chat(client, cfg, messages, max_tokens, turn=turn)
    return TurnResult(turn, r.ok, r.ttft, r.e2e, r.output_tokens, r.prompt_tokens, r.cached_tokens,
                      "content" if r.text else "", r.text, r.error)


async def run_session(send: Callable[[httpx.AsyncClient, int], Any], turns: int,
                      label: str = "") -> tuple[list[TurnResult], float]:
    """The turns back to back, as an agent with instant tools would send them; stops at a failure."""
    results: list[TurnResult] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), trust_env=False) as client:
        t0 = time.perf_counter()
        for turn in range(1, turns + 1):
            result = await send(client, turn)
            results.append(result)
            print(f"  {label or f'turn {turn}'}: TTFT {result.ttft_s * 1000:7.0f} ms, e2e {result.e2e_s * 1000:7.0f} ms, "
                  f"prompt {result.prompt_tokens}, cached {result.cached_tokens}, out {result.output_tokens}"
                  + (f", ERROR {result.error}" if result.error else ""), flush=True)
            if not result.ok:
                break
        return results, time.perf_counter() - t0


def _sender(api: str, cfg: EndpointConfig, trace: AgentTrace, max_tokens: int) -> Callable[[httpx.AsyncClient, int], Any]:
    if api == "messages":
        return lambda client, turn: stream_messages(
            client, cfg.base_url, anthropic_body(trace, turn, cfg.model, max_tokens, cfg.extra_body), turn)
    return lambda client, turn: stream_chat_turn(client, cfg, chat_messages(trace, turn), max_tokens, turn)


async def _warmup(cfg: EndpointConfig) -> None:
    """First-call costs (allocation, a longer prefill) out of turn 1, sharing no prefix with the trace."""
    text = " ".join(f"warm {i} up" for i in range(120))
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), trust_env=False) as client:
        await stream_chat(client, cfg, [{"role": "user", "content": text}], 4)


def run_server(name: str, api: str, model_dir: Path, port: int, out: Path, trace: AgentTrace,
               max_tokens: int) -> dict[str, Any]:
    spec = make_spec(name, model_dir, port, out)
    skipped = unavailable(name, spec)
    if skipped is not None:
        return skipped
    load_before = os.getloadavg()[0]
    try:
        with serving(spec, out) as (_, cfg, ready_s):
            asyncio.run(_warmup(cfg))
            print(f"[{name}] serving after {ready_s:.1f} s; session over {api}", flush=True)
            turns, session_s = asyncio.run(run_session(_sender(api, cfg, trace, max_tokens), trace.turns))
    except Exception as exc:  # noqa: BLE001 - one server failing must not lose the other's numbers
        print(f"[{name}] FAILED: {exc}", flush=True)
        return {"label": name, "failed": str(exc)[-3000:]}
    return {"label": name, "api": api, "command": spec.command_text, "ready_s": ready_s, "session_s": session_s,
            "turns": [asdict(t) for t in turns], "loadavg_1m_before": load_before,
            "loadavg_1m_after": os.getloadavg()[0]}


def run_interleaved(names: list[str], apis: dict[str, str], model_dir: Path, base_port: int, out: Path,
                    trace: AgentTrace, max_tokens: int) -> dict[str, dict[str, Any]]:
    """Every server up at once, the turns sent to each in turn (turn k to A then B, turn k+1 to B then
    A): one server works at a time, and a drift of the box's speed (consecutive runs of the same code
    differed by 25% here) falls on both. Session time is the sum of a server's turns (back to back,
    as an agent with instant tools sends them). Idle, the other server costs a few % of a core."""
    specs = {name: make_spec(name, model_dir, base_port + i, out) for i, name in enumerate(names)}
    with contextlib.ExitStack() as stack:
        cfgs = {}
        for name, spec in specs.items():
            print(f"[{name}] starting: {spec.command_text}", flush=True)
            _, cfgs[name], ready_s = stack.enter_context(serving(spec, out))
            asyncio.run(_warmup(cfgs[name]))
            print(f"[{name}] serving after {ready_s:.1f} s; session over {apis[name]}", flush=True)
        sends = {name: _sender(apis[name], cfgs[name], trace, max_tokens) for name in names}
        turns: dict[str, list[TurnResult]] = {name: [] for name in names}
        interrupted = False
        try:
            for turn in range(1, trace.turns + 1):
                for name in (names if turn % 2 else names[::-1]):
                    [result], _ = asyncio.run(run_session(lambda client, _t, n=name, k=turn: sends[n](client, k), 1,
                                                          label=f"[{name}] turn {turn}"))
                    turns[name].append(result)
        except KeyboardInterrupt:  # (a time limit's SIGINT) keep the turns measured; the servers stop below
            print("interrupted: stopping the servers, keeping the turns measured so far", flush=True)
            interrupted = True
    return {name: {"label": name, "api": apis[name], "command": specs[name].command_text,
                   "session_s": sum(t.e2e_s for t in turns[name]), "order": "interleaved",
                   "turns": [asdict(t) for t in turns[name]], **({"interrupted": True} if interrupted else {})}
            for name in names}


def token_counter(model_dir: Path) -> tuple[Any, Callable[[str], int]]:
    """The model's Hugging Face tokenizer and a token count of plain text with it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return tok, lambda text: len(tok.encode(text, add_special_tokens=False))


def expected_prompt_tokens(tok: Any, trace: AgentTrace) -> list[int]:
    """Each turn's prompt length through the model's own chat template, counted here."""
    return [len(tok.encode(tok.apply_chat_template(chat_messages(trace, k), add_generation_prompt=True,
                                                   tokenize=False), add_special_tokens=False))
            for k in range(1, trace.turns + 1)]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"{QUICK_TURNS} turns, no docs: a smoke run")
    p.add_argument("--turns", type=int, default=None, help="turns to replay (1-10; default 10)")
    p.add_argument("--model", default="default", help="mlx-lm model dir; default: the default model, float32")
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--pomona-api", choices=["messages", "chat"], default="messages",
                   help="Pomona's route: /v1/messages (the benchmark) or /v1/chat/completions (harness check)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--order", choices=["interleaved", "sequential"], default="interleaved",
                   help="interleaved: both servers up, each turn sent to one then the other (default); "
                        "sequential: one server's whole session, then the other's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-port", type=int, default=18140)
    p.add_argument("--out", default=f"benchmarks/results/agent-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--note", action="append", default=[], help="a line for the docs section's notes (repeatable)")
    p.add_argument("--from-results", default=None, metavar="JSON",
                   help="print and write the docs section from this results.json instead of measuring")
    p.add_argument("--docs", default="docs/benchmarks.md", help="page whose agent-session section is replaced "
                   "('' to skip; --quick skips it)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.harness.models import benchmark_model_dir

    args = _parse(argv)
    if args.from_results:
        data = json.loads(Path(args.from_results).read_text())
        print_report(data)
        if args.docs:
            print(f"docs: {write_docs(Path(args.docs), data, args.note)}")
        return 0
    command = "python -m benchmarks.agent.agent_session " + " ".join(argv if argv is not None else sys.argv[1:])
    model_dir = benchmark_model_dir(args.model)
    out = Path(args.out).resolve()
    tok, tok_count = token_counter(model_dir)
    trace = build_trace(tok_count, args.turns or (QUICK_TURNS if args.quick else 10), args.seed)
    expected = expected_prompt_tokens(tok, trace)
    print(f"trace: system {tok_count(chat_messages(trace, 1)[0]['content'])} tokens, tool results "
          f"{[tok_count(s.result) for s in trace.steps]}, prompts {expected}", flush=True)
    data: dict[str, Any] = {"command": command.strip(), "commit": versions()["pomona commit"],
                            "model_dir": str(model_dir), "max_tokens": args.max_tokens,
                            "expected_prompt_tokens": expected, "servers": {}}
    names = args.servers.split(",")
    apis = {name: args.pomona_api if name.startswith("pomona") else "chat" for name in names}
    if args.order == "interleaved" and all(not available(make_spec(n, model_dir, 0, out)) for n in names):
        data["servers"] = run_interleaved(names, apis, model_dir, args.base_port, out, trace, args.max_tokens)
    else:  # one server's whole session, then the other's (or a server is missing: run what is there)
        for i, name in enumerate(names):
            data["servers"][name] = run_server(name, apis[name], model_dir, args.base_port + i, out, trace,
                                               args.max_tokens)
            write_json(out / "results.json", data)  # after each server, so a crash keeps the other
    data["order"] = args.order
    write_json(out / "results.json", data)
    print_report(data)
    if args.docs and not args.quick:
        print(f"docs: {write_docs(Path(args.docs), data, args.note)}")
    print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
