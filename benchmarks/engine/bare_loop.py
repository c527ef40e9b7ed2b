"""The reference: mlx-lm's `BatchGenerator` driven by a plain loop, no HTTP, no scheduler.

The model is loaded as Pomona's engine loads it (see `load`): the loop is Pomona without its
serving stack, not a peer; the peers run mlx-lm's model as it comes.

Closed loop like the HTTP client: at most `concurrency` requests in flight, a new one inserted as
soon as one finishes. No stop tokens, so every request produces exactly `max_tokens` tokens, the
same fixed-length outputs the servers are asked for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

from benchmarks.harness.client import percentile


@dataclass(frozen=True)
class BareResult:
    concurrency: int
    requests: int
    output_tokens: int
    prompt_tokens: int
    duration_s: float
    ttft_ms_p50: float
    ttft_ms_mean: float

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "output_throughput": self.output_throughput}


def chat_prompts(tokenizer: Any, conversations: Sequence[Sequence[dict[str, str]]]) -> list[list[int]]:
    """Token ids the servers would build for these chat messages (same chat template)."""
    return [list(tokenizer.apply_chat_template(list(msgs), add_generation_prompt=True))
            for msgs in conversations]


def run_bare(model: Any, prompts: Sequence[Sequence[int]], max_tokens: int, concurrency: int,
             prefill_batch_size: int = 8) -> BareResult:
    """Run every prompt through one BatchGenerator with `concurrency` slots; time it end to end."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=None,
                         completion_batch_size=max(concurrency, prefill_batch_size),
                         prefill_batch_size=min(prefill_batch_size, concurrency))
    pending = list(prompts)
    sent: dict[int, float] = {}
    first: dict[int, float] = {}
    done = out_tokens = 0
    t0 = time.perf_counter()
    try:
        while done < len(prompts):
            free = concurrency - (len(sent) - done)
            if free > 0 and pending:
                batch, pending = pending[:free], pending[free:]
                now = time.perf_counter()
                for uid in gen.insert([list(p) for p in batch], max_tokens=[max_tokens] * len(batch)):
                    sent[uid] = now
            _, generated = gen.next()
            now = time.perf_counter()
            for g in generated:
                out_tokens += 1
                first.setdefault(g.uid, now)
                if g.finish_reason is not None:
                    done += 1
    finally:
        gen.close()
    duration = time.perf_counter() - t0
    ttfts = [first[u] - sent[u] for u in sent]
    return BareResult(concurrency=concurrency, requests=len(prompts), output_tokens=out_tokens,
                      prompt_tokens=sum(len(p) for p in prompts), duration_s=duration,
                      ttft_ms_p50=percentile(ttfts, 50) * 1000, ttft_ms_mean=sum(ttfts) / len(ttfts) * 1000)


def load(model_dir: str) -> tuple[Any, Any]:
    """The model as Pomona's engine loads it (float32 on the CPU, with its CPU fast paths), so the
    ratio of Pomona over HTTP to this loop is the cost of the serving stack alone."""
    from pathlib import Path

    from modelio.models import load_model

    loaded = load_model(Path(model_dir))
    return loaded.model, loaded.tokenizer


def sweep(model_dir: str, quick: bool, concurrencies: Sequence[int]) -> dict[str, Any]:
    """The random workload of the side-by-side suite at each concurrency, first turns only."""
    from benchmarks.harness.workloads import TextMaker, build, first_turn_messages, full_suite, quick_suite

    suite = quick_suite() if quick else full_suite()
    model, tokenizer = load(model_dir)
    maker = TextMaker(model_dir)
    warm = chat_prompts(tokenizer, [[{"role": "user", "content": "warm up"}]] * 2)
    run_bare(model, warm, 4, 2)  # first-call costs out of the numbers, as the servers get a warmup
    out = {}
    for c in concurrencies:
        convs = build(suite.sweep_spec(c), maker)
        prompts = chat_prompts(tokenizer, [first_turn_messages(conv) for conv in convs])
        out[str(c)] = run_bare(model, prompts, suite.random.output_len, c).as_dict()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m benchmarks.engine.bare_loop MODEL_DIR [--quick] [--concurrency 8,16]`: JSON on stdout.

    A separate process so it gets the same LD_PRELOAD (BLAS) as the servers."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("model_dir")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--concurrency", default="1,8,16,32")
    args = p.parse_args(argv)
    result = sweep(args.model_dir, args.quick, [int(x) for x in args.concurrency.split(",")])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    from benchmarks.harness.servers import ensure_blas

    ensure_blas()  # as the servers run: Debian's OpenBLAS preloaded (MLX's bundled BLAS is ~15x slower here)
    raise SystemExit(main())
