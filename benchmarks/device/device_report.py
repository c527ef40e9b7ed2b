"""Tables of the device benchmark (see `benchmarks/device/device_bench.py`)."""

from __future__ import annotations

import statistics

LABELS = {"raw": "raw step", "pipelined": "raw, pipelined + tolist", "+logprobs": "raw, pipelined + logprobs split",
          "bare": "bare BatchGenerator", "engine": "Pomona engine (AsyncEngine)",
          "bare_thread": "bare, on a fresh thread"}


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _summary(by: dict) -> dict:
    summary = {}
    for variant in ("raw", "pipelined", "+logprobs"):
        ms = [r["ms_per_step"] for r in by["raw"] if r["variant"] == variant]
        summary[variant] = {"ms": _median(ms), "tps": None, "spread": ms, "steps": by["raw"][0]["steps"] if ms else 0}
    for mode in ("bare", "engine", "bare_thread"):
        ms = [r["steady"]["mean"] for r in by[mode]]
        summary[mode] = {"ms": _median(ms), "tps": _median([r["tokens_per_s"] for r in by[mode]]),
                         "spread": ms, "steps": _median([r["steady"]["steps"] for r in by[mode]])}
    return summary


def summarize(results: dict) -> tuple[str, dict]:
    lines = ["| N | mode | end-to-end tok/s | steady ms/step | steady tok/s | spread ms/step | steady steps |",
             "| --- | --- | ---: | ---: | ---: | --- | ---: |"]
    ratios = {}
    for n, by in results["runs"].items():
        summary = _summary(by)
        for name, s in summary.items():
            if s["ms"] is None and s["tps"] is None:
                continue
            steady_tps = None if s["ms"] is None else by["n"] * 1e3 / s["ms"]
            spread = "/".join(_fmt(v) for v in s["spread"]) if s["spread"] else "-"
            lines.append(f"| {n} | {LABELS[name]} | {_fmt(s['tps'], ',.0f')} | {_fmt(s['ms'])} | "
                         f"{_fmt(steady_tps, ',.0f')} | {spread} | {_fmt(s['steps'], '.0f')} |")
        ratios[n] = {
            "engine/bare tok/s (end to end)": _ratio(summary["engine"]["tps"], summary["bare"]["tps"]),
            "engine/bare (steady step, bare ms / engine ms)": _ratio(summary["bare"]["ms"], summary["engine"]["ms"]),
            "bare/raw (steady step, raw ms / bare ms)": _ratio(summary["raw"]["ms"], summary["bare"]["ms"]),
            "paired": paired(by),
        }
    lines += ["", "| N | engine/bare tok/s (end to end) | engine/bare (steady step) | bare/raw (steady step) |",
              "| --- | ---: | ---: | ---: |"]
    for n, r in ratios.items():
        vals = list(r.values())[:3]
        lines.append(f"| {n} | {_fmt(vals[0], '.3f')} | {_fmt(vals[1], '.3f')} | {_fmt(vals[2], '.3f')} |")
    return "\n".join(lines), ratios


def paired(by: dict, goal: float = 0.95) -> dict:
    """engine/bare end to end, pair by pair (repeat i's engine run against repeat i's bare run).

    The host's speed drifts between repeats by more than the 5% being tested, so a pair, run back to
    back, is the unit of comparison: per-repeat ratios, their median, and the ratio of total wall
    times (every run produces the same tokens, so bare wall / engine wall = engine/bare tok/s over all
    repeats). Split by which ran first, to show an order effect if there is one.
    """
    pairs = list(zip(by["bare"], by["engine"]))
    order = by.get("order") or ["bare-engine"] * len(pairs)
    ratios = [e["tokens_per_s"] / b["tokens_per_s"] for b, e in pairs]
    bare_wall, engine_wall = sum(b["wall_s"] for b, _ in pairs), sum(e["wall_s"] for _, e in pairs)
    by_first = {first: [r for r, o in zip(ratios, order) if o.startswith(first)] for first in ("bare", "engine")}
    return {"ratios": ratios, "order": order[:len(pairs)], "median": _median(ratios),
            "mean": statistics.fmean(ratios) if ratios else None,
            "min": min(ratios, default=None), "max": max(ratios, default=None),
            "at_or_above_goal": sum(r >= goal for r in ratios), "goal": goal,
            "total_wall_bare_over_engine": _ratio(bare_wall, engine_wall),
            "median_bare_first": _median(by_first["bare"]), "median_engine_first": _median(by_first["engine"]),
            "bare_tps": [b["tokens_per_s"] for b, _ in pairs], "engine_tps": [e["tokens_per_s"] for _, e in pairs]}


def paired_table(results: dict) -> str:
    """The verdict table: one row per workload with every pair, in order (b = bare ran first, e =
    engine ran first)."""
    lines = ["| N | bare tok/s (median) | engine tok/s (median) | engine/bare each repeat, paired | median paired | "
             "median, bare first / engine first | total wall, bare/engine | pairs >= 0.95 |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for n, by in results["runs"].items():
        pr = paired(by)
        if not pr["ratios"]:
            continue
        each = " / ".join(f"{r:.3f}{o[0]}" for r, o in zip(pr["ratios"], pr["order"]))
        lines.append(f"| {n} | {_fmt(_median(pr['bare_tps']), ',.0f')} | {_fmt(_median(pr['engine_tps']), ',.0f')} | "
                     f"{each} | {_fmt(pr['median'], '.3f')} | {_fmt(pr['median_bare_first'], '.3f')} / "
                     f"{_fmt(pr['median_engine_first'], '.3f')} | {_fmt(pr['total_wall_bare_over_engine'], '.3f')} | "
                     f"{pr['at_or_above_goal']}/{len(pr['ratios'])} |")
    return "\n".join(lines)


def phases_table(results: dict) -> str:
    lines = ["| run | steps | prefill steps (s) | steady steps (s) | other decode steps (s) | wall s |",
             "| --- | ---: | --- | --- | --- | ---: |"]
    for label, by in results["runs"].items():
        for mode in ("bare", "engine", "bare_thread"):
            for r in by[mode]:
                ph = r["phases"]
                cells = [f"{ph[k]['steps']} ({ph[k]['seconds']:.2f})" for k in ("prefill", "steady", "other decode")]
                lines.append(f"| {mode} {label} | {r['steps']} | " + " | ".join(cells) + f" | {r['wall_s']:.2f} |")
    return "\n".join(lines)


def raw_table(results: dict) -> str:
    lines = ["| N | raw rung | ms/step | graph build ms | launch + wait ms |", "| --- | --- | ---: | ---: | ---: |"]
    for n, by in results["runs"].items():
        for r in by["raw"]:
            lines.append(f"| {n} | {r['variant']} | {r['ms_per_step']:.3f} | {r['graph_build_ms']:.3f} | "
                         f"{r['launch_and_wait_ms']:.3f} |")
    return "\n".join(lines)


def cpu_lines(results: dict) -> str:
    lines = []
    for n, by in results["runs"].items():
        for r in by["bare"]:
            lines.append(f"# bare N={n}: CPU ms/step of the calling thread {r['cpu_ms_per_step']['main_thread']:.3f}")
        for r in by["engine"] + by["engine_profile"]:
            cpu = r["cpu_ms_per_step"]
            lines.append(f"# engine N={n}{' (profiled)' if 'parts_ms' in r else ''}: CPU ms/step mlx thread "
                         f"{cpu['mlx_thread']:.3f}, asyncio thread {cpu['asyncio_thread']:.3f}")
    return "\n".join(lines)


def rep_line(label: str, rep: int, by: dict) -> str:
    last = {k: by[k][-1] for k in ("bare", "engine") if by[k]}
    pair = (f"; engine/bare {last['engine']['tokens_per_s'] / last['bare']['tokens_per_s']:.3f}"
            if len(last) == 2 else "")
    raw = ("; raw " + ", ".join(f"{r['variant']} {r['ms_per_step']:.2f}" for r in by["raw"][-3:])) if by["raw"] else ""
    order = f" ({by['order'][-1]})" if by.get("order") else ""
    return (f"# {label} rep {rep}{order}: " + "; ".join(
        f"{k} {r['tokens_per_s']:,.0f} tok/s, steady {_fmt(r['steady']['mean'])} ms/step" for k, r in last.items())
        + pair + raw)
