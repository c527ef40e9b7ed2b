"""Speculative decoding side by side: the engine in process with `engine.speculative` off and on,
one stream and N concurrent (a closed loop of --per-level x N requests), on a code-edit workload
and on random text, in one run.

    python -m benchmarks.engine.speculative [MODEL_DIR] [--concurrency 1,8,32] [--max-tokens 300]
        [--repeats 1] [--spec '{"max_tokens": 8}'] [--quick]

- code-edit: a prompt holding a ~300-token Python file and a request to repeat it with one small
  edit (each request names a different rename, so requests differ), greedy: the answer is mostly
  the file again, which prompt lookup predicts.
- random text: random words and a request to continue them, greedy: nothing in the prompt to look up.

Both engines run serve_config.yaml's engine settings (prefix cache in RAM, no SSD tier) but for
`speculative`; each is warmed on the workload's shared prefix first, and levels alternate off/on
so drift on a shared machine hits both. Greedy outputs must be token-identical on and off: the run
says so per level ("same"). Prints a table and, as the last line, JSON.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any, Callable, Sequence

FILE = '''import csv
import sys
from dataclasses import dataclass


@dataclass
class Row:
    name: str
    city: str
    age: int


def parse_line(line: str) -> Row:
    name, city, age = line.strip().split(",")
    return Row(name=name, city=city, age=int(age))


def load_rows(path: str) -> list[Row]:
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(parse_line(line))
    return rows


def average_age(rows: list[Row]) -> float:
    if not rows:
        return 0.0
    return sum(r.age for r in rows) / len(rows)


def by_city(rows: list[Row]) -> dict[str, list[Row]]:
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(r.city, []).append(r)
    return groups


def main() -> int:
    rows = load_rows(sys.argv[1])
    print(f"{len(rows)} rows, average age {average_age(rows):.1f}")
    for city, members in sorted(by_city(rows).items()):
        print(city, len(members), average_age(members))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
'''

RENAMES = [("parse_line", "parse_row"), ("load_rows", "read_rows"), ("average_age", "mean_age"),
           ("by_city", "group_by_city"), ("main", "run"), ("Row", "Person")]

WORDS = ("river stone apple window quiet market orange silver thunder garden paper lantern cloud "
         "forest engine copper violet harbor meadow candle bridge falcon velvet saddle").split()


def code_edit_messages(i: int) -> list[dict[str, str]]:
    old, new = RENAMES[i % len(RENAMES)]
    return [{"role": "user", "content": f"Here is a file:\n\n```python\n{FILE}```\n\nRepeat the whole file "
                                        f"with one change: rename `{old}` to `{new}` everywhere. Output only "
                                        "the code."}]


def random_text_messages(i: int) -> list[dict[str, str]]:
    rng = random.Random(i)
    text = " ".join(rng.choice(WORDS) for _ in range(80))
    return [{"role": "user", "content": f"Continue this text with new sentences: {text}"}]


WORKLOADS = {"code-edit": code_edit_messages, "random": random_text_messages}


def agent_turns(tokenizer: Any, room: int) -> Callable[[int], list[dict[str, str]]]:
    """The agent session's turns 2-10 (benchmarks/agent/agent_trace.py, 5-8k-token prompts with SmolLM2's
    tokenizer) as chat messages, request i taking the i-th of those whose prompt leaves `room` tokens
    for itself and its answer (the model's context less max_tokens: the real SmolLM2's 8,192 holds
    turns 2-9 with 300 tokens to answer, not turn 10's 8,080): the decode after a long context that
    re-emits paths, names and code from it."""
    from benchmarks.agent.agent_trace import build_trace, chat_messages
    from benchmarks.engine.bare_loop import chat_prompts

    trace = build_trace(lambda text: len(tokenizer.encode(text)))
    turns = [t for t in range(2, 11) if len(chat_prompts(tokenizer, [chat_messages(trace, t)])[0]) <= room]
    if not turns:
        raise SystemExit(f"no agent turn fits {room} tokens: lower --max-tokens or use a longer-context model")
    return lambda i: chat_messages(trace, turns[i % len(turns)])


async def _one(engine: Any, tokens: Sequence[int], max_tokens: int, rid: str) -> list[int]:
    from engine.types import Request, SamplingParams

    req = Request(tuple(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                  request_id=rid)
    out: list[int] = []
    async for batch in engine.stream(req):
        for e in batch:
            if e.error:
                raise RuntimeError(f"request failed in the engine: {e.error}")
            if e.token_id is not None:
                out.append(e.token_id)
    return out


async def level(engine: Any, prompts: list[list[int]], max_tokens: int, tag: str, concurrency: int) -> dict[str, Any]:
    """`prompts` in a closed loop, at most `concurrency` in flight (a new one as soon as one ends):
    output tokens/s over the whole level. (All at once and waiting for the last would time the
    slowest request: speculation that speeds the others would only leave the batch smaller.)"""
    runner = (await engine.call(lambda e: e.status()))["runner"]
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, p: list[int]) -> list[int]:
        async with gate:
            return await _one(engine, p, max_tokens, f"{tag}-{i}")

    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    duration = time.perf_counter() - t0
    after = (await engine.call(lambda e: e.status()))["runner"]
    proposed = after.get("spec_proposed_tokens", 0) - runner.get("spec_proposed_tokens", 0)
    accepted = after.get("spec_accepted_tokens", 0) - runner.get("spec_accepted_tokens", 0)
    tokens = sum(len(o) for o in outs)
    # The GPU's gate: steps it kept from verifying during this level, and its periods after it
    # (engine/step/speculative.py SpecGate), so a level that gained little says whether the gate held it back.
    declined = after.get("spec_declined_steps", 0) - runner.get("spec_declined_steps", 0)
    # A GPU's verifying steps built before the step in flight was read, and the rows' parts of them
    # dropped because that step did not accept all their proposals (engine/step/step_runner.py `_chains`).
    chained, void = (after.get(k, 0) - runner.get(k, 0) for k in ("spec_chained_steps", "spec_void_rows"))
    return {"tok_s": tokens / duration, "tokens": tokens, "duration_s": duration, "outputs": outs,
            "proposed": proposed, "accepted": accepted, "kind": after.get("kind"),
            "steps": after.get("spec_steps", 0) - runner.get("spec_steps", 0), "chained": chained, "void": void,
            "declined_steps": declined, "gate_ms": after.get("spec_gate_ms", {}),
            "memory_gb": await engine.call(_memory)}


def _memory(engine: Any) -> dict[str, float]:
    """On the engine's MLX thread: MLX's memory (process-wide: both engines of this benchmark) and
    this engine's RAM tier, in GB. Why: the H100 run of session 28 stopped in the agent workload at 8
    streams with `cudaGraphInstantiate ... out of memory`, and said nothing of where memory went."""
    import mlx.core as mx

    ram = engine.store.stats().get("ram", {})
    return {"active": round(mx.get_active_memory() / 1e9, 2), "cache": round(mx.get_cache_memory() / 1e9, 2),
            "peak": round(mx.get_peak_memory() / 1e9, 2), "ram_tier": round(ram.get("bytes", 0) / 1e9, 2)}


def run(model: str, concurrencies: Sequence[int], max_tokens: int, repeats: int, spec: Any,
        workloads: Sequence[str], max_running: int | None, per_level: int = 2, alone: int = 0) -> dict[str, Any]:
    """`alone`: also run that many of a level's prompts one at a time with speculation off, and say
    whether the batched "off" outputs equal them: when they do not, batching alone changes greedy
    output (a backend's numerics with another batch shape), and a difference between "on" and
    "off" there is no fault of speculation. Repeats >= 2 also compare the two "off" runs."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from benchmarks.engine.bare_loop import chat_prompts
    from benchmarks.engine.engine_loop import engine_config
    from engine.loop import AsyncEngine
    from modelio.models import resolve_model

    model_dir = str(resolve_model(model)) if model == "default" else model
    tokenizer = load_tokenizer(__import__("pathlib").Path(model_dir))
    need = max(max(concurrencies), max_running or 0)
    engines = {name: AsyncEngine(engine_config(model_dir, need, None, True, {"speculative": value}))
               for name, value in (("off", "off"), ("on", spec))}
    results: dict[str, Any] = {}

    async def main() -> None:
        for engine in engines.values():
            await engine.wait_ready()
        for workload in workloads:
            room = (engines["off"].context_length or 1 << 30) - max_tokens
            make = agent_turns(tokenizer, room) if workload == "agent" else WORKLOADS[workload]
            for name, engine in engines.items():  # the shared prefix cached, kernels warm
                await level(engine, chat_prompts(tokenizer, [make(10_000)]), 8, f"warm-{workload}-{name}", 1)
            for c in concurrencies:
                prompts = chat_prompts(tokenizer, [make(i) for i in range(per_level * c)])
                row: dict[str, Any] = {"off": [], "on": []}
                for r in range(repeats):
                    order = ("off", "on") if r % 2 == 0 else ("on", "off")
                    for name in order:
                        row[name].append(await level(engines[name], prompts, max_tokens, f"{workload}-{c}-{r}-{name}", c))
                off = max(x["tok_s"] for x in row["off"])
                on = max(x["tok_s"] for x in row["on"])
                same = all(a["outputs"] == b["outputs"] for a, b in zip(row["off"], row["on"]))
                pairs = list(zip(row["off"][0]["outputs"], row["on"][0]["outputs"]))
                checks: dict[str, Any] = {"same_requests": f"{sum(a == b for a, b in pairs)}/{len(pairs)}"}
                if repeats >= 2:
                    checks["off_repeat_same"] = row["off"][0]["outputs"] == row["off"][1]["outputs"]
                if alone:
                    solo = await level(engines["off"], prompts[:alone], max_tokens, f"{workload}-{c}-alone", 1)
                    checks["off_alone_same"] = f"{sum(a == b for a, b in zip(solo['outputs'], row['off'][0]['outputs']))}/{len(solo['outputs'])}"
                    checks["on_alone_same"] = f"{sum(a == b for a, b in zip(solo['outputs'], row['on'][0]['outputs']))}/{len(solo['outputs'])}"
                proposed = sum(x["proposed"] for x in row["on"])
                accepted = sum(x["accepted"] for x in row["on"])
                results[f"{workload}/{c}"] = {
                    "workload": workload, "concurrency": c, "off_tok_s": round(off, 2), "on_tok_s": round(on, 2),
                    "ratio": round(on / off, 3), "same_tokens": same, "proposed": proposed, "accepted": accepted,
                    "accept_rate": round(accepted / proposed, 3) if proposed else None,
                    "tokens_per_request": round(row["on"][0]["tokens"] / len(prompts), 1),
                    "runner": row["on"][0]["kind"], "declined_steps": [x["declined_steps"] for x in row["on"]],
                    "verify_steps": sum(x["steps"] for x in row["on"]), "chained_steps": sum(x["chained"] for x in row["on"]),
                    "void_rows": sum(x["void"] for x in row["on"]),
                    "gate_ms": row["on"][-1]["gate_ms"], "memory_gb": row["on"][-1]["memory_gb"], **checks}
                print(_line(results[f"{workload}/{c}"]), flush=True)
        for engine in engines.values():
            await engine.shutdown(drain_s=0)

    asyncio.run(main())
    return results


def _line(r: dict[str, Any]) -> str:
    return (f"{r['workload']:>10} c={r['concurrency']:<3} off {r['off_tok_s']:8.1f} tok/s  on {r['on_tok_s']:8.1f} "
            f"tok/s  x{r['ratio']:.2f}  same={r['same_tokens']}  accepted {r['accepted']}/{r['proposed']}"
            + "".join(f"  {k}={r[k]}" for k in ("same_requests", "off_repeat_same", "off_alone_same", "on_alone_same")
                      if k in r)
            + (f"  verify_steps={r['verify_steps']} chained={r['chained_steps']} void={r['void_rows']}"
               if r.get("verify_steps") else "")
            + (f"  declined={r['declined_steps']} gate_ms={r['gate_ms']}" if r.get("gate_ms") else "")
            + (f"  memory_gb={r['memory_gb']}" if r.get("memory_gb") else ""))


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    import yaml

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="default", help="an mlx-lm model directory (default: Pomona's default)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--repeats", type=int, default=1, help="runs per level and setting (the best is kept)")
    p.add_argument("--spec", default="auto", help='the "on" setting: auto or a YAML/JSON mapping')
    p.add_argument("--workloads", default="code-edit,random", help="of code-edit, random, agent")
    p.add_argument("--max-running", type=int, default=None)
    p.add_argument("--per-level", type=int, default=2, help="requests per level, in units of its concurrency")
    p.add_argument("--alone", type=int, default=0, metavar="N",
                   help="also run N of each level's prompts alone, speculation off, and compare (batch numerics)")
    p.add_argument("--quick", action="store_true", help="1 and 8 concurrent, 128 tokens (the 2-core CPU box)")
    args = p.parse_args(argv)
    concurrencies = [1, 8] if args.quick else [int(c) for c in args.concurrency.split(",")]
    max_tokens = 128 if args.quick else args.max_tokens
    results = run(args.model, concurrencies, max_tokens, args.repeats, yaml.safe_load(args.spec),
                  args.workloads.split(","), args.max_running, args.per_level, args.alone)
    print(json.dumps({"model": args.model, "max_tokens": max_tokens, "spec": args.spec, "results": results}))
    return 0


if __name__ == "__main__":
    from benchmarks.harness.servers import ensure_blas

    ensure_blas()  # as the servers run: Debian's OpenBLAS preloaded (MLX's bundled BLAS is ~15x slower here)
    raise SystemExit(main())
