"""Tables of the device benchmark (see `benchmarks/device_bench.py`)."""

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
        }
    lines += ["", "| N | engine/bare tok/s (end to end) | engine/bare (steady step) | bare/raw (steady step) |",
              "| --- | ---: | ---: | ---: |"]
    for n, r in ratios.items():
        vals = list(r.values())
        lines.append(f"| {n} | {_fmt(vals[0], '.3f')} | {_fmt(vals[1], '.3f')} | {_fmt(vals[2], '.3f')} |")
    return "\n".join(lines), ratios


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
    return (f"# {label} rep {rep}: " + "; ".join(
        f"{k} {r['tokens_per_s']:,.0f} tok/s, steady {_fmt(r['steady']['mean'])} ms/step" for k, r in last.items())
        + "; raw " + ", ".join(f"{r['variant']} {r['ms_per_step']:.2f}" for r in by["raw"][-3:]))
