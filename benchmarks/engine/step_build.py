"""The host time of building one GPU-shaped step, nothing run: what a host-bound GPU pays per step.

Why: on a GPU a small model's step is bound by the host building it in Python (MLX's graph, the
table's views, sampling), and the own step overlaps that with the device running the previous step.
So the build's cost per kind of step is what decides, e.g., whether a step that also feeds a prompt
chunk should be one flat forward (`engine.flat_step`) or two, and what a verifying step's rows cost.
This builds the own step as a GPU runs it (`StepRunner(on_cpu=False)`: bucketed rows and prefill
shapes, `FlatAttention` swapped in) with `mx.async_eval` made a no-op in the step runner, so nothing
is computed and the time is the host's alone, on whatever machine runs it (the device's host too).

    python -m benchmarks.engine.step_build [MODEL] [--rows 4] [--chunk 77] [--rounds 40]

Kinds: `decode` (the rows decode), `mixed-two` (the rows decode and one prompt feeds a chunk of
`--chunk` tokens, two forwards), `mixed-flat` (the same as one flat forward), `verify` (every row
verifies its most proposals, prompt lookup's 8, at the GPU's fixed width: issue 34's verifying step,
whose period at 32 rows the H100 measured at twice a plain one's). Prints the median milliseconds
of each, alternated round by round; JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Sequence


def runner(model: Any, rows: int, flat: bool, speculative: str = "off") -> Any:
    """A GPU-shaped runner with `rows` rows decoding (their 51-token prompts given as cached: nothing
    computed) and its table grown once. Benchmark code: it reaches into the runner's own state."""
    import mlx.core as mx

    from engine.config import EngineConfig
    from engine.sampling import make_decoding
    from engine.step.step_runner import StepRunner
    from engine.types import SamplingParams

    made = StepRunner(model, EngineConfig(model="bench", flat_step=flat, speculative=speculative, max_running=max(8, 2 * rows),
                                          prefill_batch=4), on_cpu=False)
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i in range(rows):
        made.insert(f"d{i}", [5], list(range(10 + i, 60 + i)), None, make_decoding(params, 51, []), 400)
        made._slots[f"d{i}"].fed = 1  # noqa: SLF001 - decoding from the start
    made._grow(rows + 2, 640)  # noqa: SLF001 - the table at its size, so no step grows it (1 GB at 32 rows)
    mx.eval(made._kv.arrays())  # noqa: SLF001
    return made


def build_once(made: Any, rows: int, chunk: int, k: int, verify: bool = False) -> float:
    """One step's build time (seconds): the rows reset to 51 positions, and a chunk's prompt when
    `chunk`; with `verify` every row verifies the most proposals a row may make."""
    from engine.sampling import make_decoding
    from engine.types import SamplingParams

    for i in range(rows):
        slot = made._slots[f"d{i}"]  # noqa: SLF001
        slot.length, slot.sampled = 51, 0
    if chunk:
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        made.insert("p", [7 + (k + j) % 300 for j in range(chunk)], [], None, make_decoding(params, chunk, []), 1)
    started = time.perf_counter()
    if verify:
        import mlx.core as mx

        decode = [made._slots[f"d{i}"] for i in range(rows)]  # noqa: SLF001
        with mx.stream(made._stream):  # noqa: SLF001 - as `_start` builds it
            made._verify_group(decode, {s: [11 + j for j in range(made.speculative.max_tokens)] for s in decode})  # noqa: SLF001
    else:
        made._start()  # noqa: SLF001 - the build alone (`step` would also read the previous step back)
    took = time.perf_counter() - started
    if chunk:
        made.remove("p")
    return took


def run(model_dir: str, rows: int, chunk: int, rounds: int) -> dict[str, float]:
    import mlx.core as mx
    import mlx_lm

    from modelio.flat_llama import flatten

    model = mlx_lm.load(model_dir)[0]
    flatten(model)
    kinds = {"decode": (runner(model, rows, True), 0), "mixed-two": (runner(model, rows, False), chunk),
             "mixed-flat": (runner(model, rows, True), chunk)}
    verifier = runner(model, rows, True, "auto")
    times: dict[str, list[float]] = {name: [] for name in kinds}
    start_work = mx.async_eval
    mx.async_eval = lambda *arrays, **_: None  # build only: the steps' graphs are made, nothing computed
    try:
        for k in range(rounds):
            for name, (made, n) in kinds.items():
                times[name].append(build_once(made, rows, n, k))
            times.setdefault("verify", []).append(build_once(verifier, rows, 0, k, verify=True))
    finally:
        mx.async_eval = start_work
    return {name: round(1000 * statistics.median(t[min(5, len(t) - 1):]), 3) for name, t in times.items()}


def main(argv: Sequence[str] | None = None) -> int:
    from modelio.models import resolve_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="default")
    p.add_argument("--rows", type=int, nargs="+", default=[4], help="one line of kinds for each")
    p.add_argument("--chunk", type=int, default=77, help="the prompt chunk's tokens (77: the prefix part's rest)")
    p.add_argument("--rounds", type=int, default=40)
    args = p.parse_args(argv)
    model_dir = str(resolve_model(args.model)) if args.model == "default" else args.model
    results = {}
    for rows in args.rows:
        results[rows] = result = run(model_dir, rows, args.chunk, args.rounds)
        for name, ms in result.items():
            print(f"{rows:>3} rows {name:>10}: {ms:.2f} ms to build", flush=True)
    print(json.dumps({"model": args.model, "rows": args.rows, "chunk": args.chunk, "build_ms": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
