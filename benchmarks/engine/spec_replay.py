"""Prompt-lookup policies replayed over recorded greedy outputs: tokens per step, whatever the machine.

    python -m benchmarks.engine.spec_replay MODEL [--workloads agent,code-edit,random] [--requests 6]
        [--max-tokens 300] [--policy 'ngram_max=5,max_tokens=16'] ... [--floor 0.1] [--save F.json | --load F.json]

Why: under greedy decoding a request's output does not depend on speculation, so how many forwards a
proposal policy needs for it is a property of the output and the policy, not of the device. The
engine (speculation off, the default serve_config.yaml settings) writes each request's output once;
each policy is then replayed through the step's own classes (`PromptLookup`, `Adaptive`), at the
acceptance floor the step gives one decoding row (`SPEC_MIN_FLOOR`, engine/step/step_runner.py) unless
`--backend cpu` or `--floor` says otherwise. On a GPU a step is bound by the host and its positions are nearly free, so
tokens per step is what speculation can gain at one stream there; what a verifying step costs beyond a
plain one (its extra host work, new shapes) is not in it: benchmarks/engine/speculative.py measures the
whole. `--save` keeps the outputs (made on one machine, replayed anywhere), `--load` replays them.

Prints one line per workload and policy, and a JSON summary on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Sequence

DEFAULT_POLICIES = ("", "max_tokens=16", "ngram_max=5,max_tokens=16")


def parse_policy(text: str) -> dict[str, Any]:
    """`"ngram_max=5,max_tokens=16"` -> SpecConfig fields to replace ("" = the defaults), plus
    `adaptive=false` (propose the limit at every step with a match)."""
    from engine.step.speculative import SpecConfig

    out: dict[str, Any] = {}
    names = {f.name for f in fields(SpecConfig)} | {"adaptive"}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = pair.partition("=")
        if key not in names:
            raise SystemExit(f"unknown policy field {key!r}; known: {sorted(names)}")
        out[key] = value.lower() not in ("0", "false", "no") if key == "adaptive" else int(value)
    return out


def replay(records: list[dict[str, list[int]]], policy: dict[str, Any], floor: float,
           padded: bool = False) -> dict[str, Any]:
    """Decode steps a policy needs for `records` ({"prompt", "output"} token lists), each request on
    its own (one decoding row). The first token comes from the prompt's prefill, as in the engine;
    then a step proposes from everything known, keeps the proposals up to the first that differs
    from the output, and emits one token more (the sample at that position). `padded`: the GPU's
    policy (`Adaptive`'s: every step proposes its most, as a fixed-width verifying step costs the same)."""
    from engine.step.speculative import Adaptive, PromptLookup, SpecConfig

    settings = dict(policy)
    adaptive = settings.pop("adaptive", True)
    config = replace(SpecConfig(), **settings)
    steps = tokens = proposed = accepted = 0
    for record in records:
        out = record["output"]
        known = list(record["prompt"]) + out[:1]
        lookup, control = PromptLookup(config.ngram_min, config.ngram_max), Adaptive(config.max_tokens, padded=padded)
        i = 1
        while i < len(out):
            k = min(control.budget(floor) if adaptive else config.max_tokens, len(out) - i - 1)
            proposals = lookup.propose(known, k) if k > 0 else []
            n = 0
            while n < len(proposals) and proposals[n] == out[i + n]:
                n += 1
            control.record(len(proposals), n)
            known.extend(out[i:i + n + 1])
            i += n + 1
            steps, tokens, proposed, accepted = steps + 1, tokens + n + 1, proposed + len(proposals), accepted + n
    # tokens: those of the decode steps (each output's first comes from the prefill)
    return {"steps": steps, "tokens": tokens, "tokens_per_step": round(tokens / max(steps, 1), 3),
            "proposed": proposed, "accepted": accepted}


def record(model: str, workloads: Sequence[str], requests: int, max_tokens: int) -> dict[str, list[dict[str, list[int]]]]:
    """Each workload's first `requests` prompts and their greedy outputs, speculation off."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from benchmarks.engine.bare_loop import chat_prompts
    from benchmarks.engine.engine_loop import engine_config
    from benchmarks.engine.speculative import WORKLOADS, _one, agent_turns
    from engine.loop import AsyncEngine

    tokenizer = load_tokenizer(Path(model))
    out: dict[str, list[dict[str, list[int]]]] = {}

    async def main() -> None:
        engine = AsyncEngine(engine_config(model, 8, None, True, {"speculative": "off"}))
        await engine.wait_ready()
        try:
            for workload in workloads:
                make = agent_turns(tokenizer, engine.context_length - max_tokens) if workload == "agent" \
                    else WORKLOADS[workload]
                prompts = chat_prompts(tokenizer, [make(i) for i in range(requests)])
                out[workload] = [{"prompt": list(p), "output": await _one(engine, p, max_tokens, f"{workload}-{i}")}
                                 for i, p in enumerate(prompts)]
        finally:
            await engine.shutdown(drain_s=0)

    asyncio.run(main())
    return out


def one_row_floor(backend: str) -> float:
    """The acceptance floor the step gives a proposal while one row decodes (`StepRunner._proposals`)."""
    from engine.step.backend import CPU, GPU
    from engine.step.step_runner import SPEC_MIN_FLOOR

    fixed = (CPU if backend == "cpu" else GPU).spec_fixed_positions
    return max(SPEC_MIN_FLOOR, 1 / (1 + fixed))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="an mlx-lm model directory (not needed with --load)")
    p.add_argument("--workloads", default="agent,code-edit,random")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--policy", action="append", default=None,
                   help=f"SpecConfig fields (and adaptive=false), repeatable; default {DEFAULT_POLICIES}")
    p.add_argument("--backend", choices=("gpu", "cpu"), default="gpu",
                   help="whose step's policy: its acceptance floor, and on the GPU every step proposing its most")
    p.add_argument("--floor", type=float, default=None, help="an acceptance floor of your own instead")
    p.add_argument("--save", default=None, help="write the recorded outputs here (JSON)")
    p.add_argument("--load", default=None, help="replay outputs recorded earlier instead of running the model")
    args = p.parse_args(argv)
    if args.load:
        data = json.loads(Path(args.load).read_text())
    elif args.model:
        data = record(args.model, args.workloads.split(","), args.requests, args.max_tokens)
    else:
        p.error("give a model directory or --load")
    if args.save:
        Path(args.save).write_text(json.dumps(data))
    floor = args.floor if args.floor is not None else one_row_floor(args.backend)
    summary: dict[str, Any] = {}
    for workload, records in data.items():
        for text in (args.policy or DEFAULT_POLICIES):
            result = replay(records, parse_policy(text), floor, padded=args.backend == "gpu")
            summary[f"{workload}/{text or 'default'}"] = result
            print(f"{workload:>10} {text or 'default':<40} {result['tokens_per_step']:.2f} tokens/step  "
                  f"({result['steps']} steps, accepted {result['accepted']}/{result['proposed']})", flush=True)
    print(json.dumps({"floor": floor, "results": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
