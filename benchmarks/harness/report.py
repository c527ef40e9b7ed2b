"""Plots and tables from benchmark results (matplotlib on the Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot loads)


def _series(server: Mapping[str, Any], key: str, sub: str | None = None) -> tuple[list[int], list[float]]:
    sweep = server.get("sweep") or {}
    xs = sorted(int(c) for c in sweep)
    ys = []
    for c in xs:
        value = sweep[str(c)][key]
        ys.append(value[sub] if sub else value)
    return xs, ys


def plot_sweep(servers: Mapping[str, Mapping[str, Any]], out_dir: Path, prefix: str = "") -> list[Path]:
    """Output tok/s and TTFT p50 against concurrency, one line per server."""
    out_dir.mkdir(parents=True, exist_ok=True)
    charts = [
        ("throughput", "output_throughput", None, "output tokens/s"),
        ("ttft", "ttft_ms", "p50", "TTFT p50 (ms)"),
    ]
    paths = []
    for name, key, sub, ylabel in charts:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, server in servers.items():
            xs, ys = _series(server, key, sub)
            if xs:
                ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ticks = sorted({int(c) for server in servers.values() for c in (server.get("sweep") or {})})
        ax.set_xticks(ticks, [str(t) for t in ticks])  # plain numbers, not powers of two
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel} vs concurrency (random workload)")
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend()
        fig.tight_layout()
        path = out_dir / f"{prefix}{name}_vs_concurrency.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
        return "—" if v is None else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def server_rows(servers: Mapping[str, Mapping[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """One row per server and sweep level: the vllm-bench-serve headline numbers."""
    header = ["server", "workload", "conc.", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms",
              "TPOT p50 ms", "ITL p50 ms", "E2E p50 ms", "cached share", "errors"]
    rows: list[list[Any]] = []
    for label, server in servers.items():
        runs = [(f"random", c, agg) for c, agg in (server.get("sweep") or {}).items()]
        runs += [(f"rate {r}/s", agg.get("concurrency"), agg) for r, agg in (server.get("rates") or {}).items()]
        for key in ("prefix", "multiturn"):
            if key in server:
                runs.append((key, server[key].get("concurrency"), server[key]))
        for name, conc, agg in runs:
            rows.append([label, name, conc, agg["request_throughput"], agg["output_throughput"],
                         agg["ttft_ms"]["p50"], agg["ttft_ms"]["p99"], agg["tpot_ms"]["p50"],
                         agg["itl_ms"]["p50"], agg["e2e_ms"]["p50"], f"{agg['cached_token_share']:.0%}",
                         agg["errors"]])
    return header, rows
