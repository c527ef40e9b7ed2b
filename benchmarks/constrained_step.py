"""Decode step with every request constrained by a grammar vs every request free, and grammar compile time.

`python -m benchmarks.constrained_step [--steps N] [--concurrency 8 32]`

In-process `Engine`s on the default model, one thread: a free one and a constrained one (same model),
run in alternating short rounds so that the load of a shared host falls on both; `Engine.step()` is
timed while all of an engine's requests are decoding. The constrained requests' grammar is a JSON array of strings that cannot
finish within the run (`minItems` far beyond it), so the batch stays whole: each step pays the mask of
a JSON string or separator position, the usual state of a JSON answer. Free requests ignore EOS for the
same reason. Goal (issue 17): constrained step <= 1.1x the free step.

Compile time: `tool_grammar` for eight agent tools (tool_choice "required"), compiled by
`engine.constraints` cold (a new grammar: `LLMatcher` compile) and cached (a `deep_copy` of the
pristine matcher), plus the one-off llguidance tokenizer build.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks.servers import ensure_blas

ARRAY_GRAMMAR_SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 100000}
PROMPT = "List, as a JSON array of strings, every fruit you can think of."


def agent_tools() -> list[Any]:
    from api.core.conversation import Tool

    def obj(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    s, i, b = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
    return [
        Tool("read_file", "Read a file", obj({"path": s, "offset": i, "limit": i}, ["path"])),
        Tool("write_file", "Write a file", obj({"path": s, "content": s}, ["path", "content"])),
        Tool("edit_file", "Replace text", obj({"path": s, "old": s, "new": s, "all": b}, ["path", "old", "new"])),
        Tool("run_shell", "Run a command", obj({"command": s, "timeout_s": i, "cwd": s}, ["command"])),
        Tool("search_code", "Grep", obj({"pattern": s, "glob": s, "case": {"enum": ["smart", "exact", "ignore"]}},
                                        ["pattern"])),
        Tool("web_fetch", "Fetch a URL", obj({"url": s, "format": {"enum": ["text", "markdown", "html"]}}, ["url"])),
        Tool("todo", "Track tasks", obj({"items": {"type": "array", "items": obj(
            {"id": i, "title": s, "status": {"enum": ["pending", "active", "done"]}}, ["id", "title", "status"])}},
            ["items"])),
        Tool("ask_user", "Ask a question", obj({"question": s, "options": {"type": "array", "items": s}},
                                               ["question"])),
    ]


def compile_times(tokenizer: Any) -> dict[str, float]:
    from llguidance import LLMatcher

    from api.core.conversation import ToolChoice
    from api.output.grammars import tool_grammar
    from engine.constraints import ConstraintFactory

    factory = ConstraintFactory(tokenizer)
    t0 = time.perf_counter()
    llg = factory.llg
    t1 = time.perf_counter()
    grammar = tool_grammar(agent_tools(), ToolChoice("required"), True, "<tool_call>", "</tool_call>", False)
    t2 = time.perf_counter()
    factory.matcher(grammar)
    t3 = time.perf_counter()
    cached = []
    for _ in range(20):
        start = time.perf_counter()
        factory.build(grammar, [1, 2, 3])
        cached.append(time.perf_counter() - start)
    fresh = []
    for _ in range(5):
        start = time.perf_counter()
        LLMatcher(llg, grammar, log_level=0)
        fresh.append(time.perf_counter() - start)
    return {"tokenizer_build_ms": (t1 - t0) * 1e3, "grammar_text_ms": (t2 - t1) * 1e3,
            "cold_compile_ms": (t3 - t2) * 1e3, "fresh_matcher_ms": statistics.median(fresh) * 1e3,
            "cached_ms": statistics.median(cached) * 1e3}


def _fill(engine: Any, n: int, constrained: bool, max_tokens: int) -> None:
    from api.core.conversation import OutputFormat
    from api.output.grammars import answer_grammar
    from engine.constraints import build_constraint
    from engine.types import Request, SamplingParams

    tok = engine.tokenizer
    grammar = answer_grammar(OutputFormat("json_schema", ARRAY_GRAMMAR_SCHEMA)) if constrained else None
    for k in range(n):
        prompt = tuple(tok.apply_chat_template([{"role": "user", "content": f"{PROMPT} ({k})"}],
                                               add_generation_prompt=True))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=grammar, ignore_eos=not constrained)
        constraint = build_constraint(tok, grammar, prompt) if constrained else None
        engine.add_request(Request(prompt, params, request_id=f"{'c' if constrained else 'f'}{n}-{k}",
                                   constraint=constraint))


def _decoding(engine: Any, n: int) -> bool:
    from engine.types import RequestStatus

    return len(engine.seqs) == n and all(s.status is RequestStatus.DECODING for s in engine.seqs.values())


def paired_steps(free: Any, constrained: Any, n: int, steps: int, rounds: int) -> tuple[list[float], list[float]]:
    """Alternate rounds of `steps` steps of the free and the constrained engine, so that the load of a
    shared host falls on both. One engine at a time: a step leaves its batch's next forward pass in
    flight (mlx-lm's pipelining), which stepping the other engine in between would charge to that one.
    Each round's first step (it may wait for the other's last) is not counted."""
    import mlx.core as mx

    total = (steps + 1) * rounds + 64
    _fill(free, n, False, total)
    _fill(constrained, n, True, total)
    times: tuple[list[float], list[float]] = ([], [])
    for engine in (free, constrained):
        while not _decoding(engine, n):
            engine.step()
    for _ in range(rounds):
        for engine, out in ((free, times[0]), (constrained, times[1])):
            mx.synchronize()
            engine.step()
            for _ in range(steps):
                start = time.perf_counter()
                engine.step()
                out.append(time.perf_counter() - start)
    for engine in (free, constrained):
        for request_id in list(engine.seqs):
            engine.abort_request(request_id)
        while engine.has_work():
            engine.step()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    args = parser.parse_args()
    ensure_blas()
    from cache_tiers.config import CacheConfig
    from engine.config import EngineConfig
    from engine.engine import Engine
    from modelio.models import load_model, resolve_model

    loaded = load_model(resolve_model("default"))
    config = EngineConfig(model="default", cache=CacheConfig(enabled=False), max_running=max(args.concurrency))
    free, constrained = (Engine(loaded.model, loaded.tokenizer, config) for _ in range(2))
    times = compile_times(loaded.tokenizer)
    print("grammar compile, 8 agent tools (tool_choice required):")
    for name, value in times.items():
        print(f"  {name:20s} {value:9.3f} ms")
    print(f"decode step, ms (median of {args.rounds} alternating rounds x {args.steps} steps each):")
    print("  concurrent      free  constrained   ratio")
    for n in args.concurrency:
        a, b = paired_steps(free, constrained, n, args.steps, args.rounds)
        fa, fb = statistics.median(a), statistics.median(b)
        print(f"  {n:10d} {fa * 1e3:9.1f} {fb * 1e3:12.1f} {fb / fa:7.3f}")
    free.close()
    constrained.close()


if __name__ == "__main__":
    main()
