"""The issue's goals as ratios measured side by side in one run (read from the table, never asserted)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

POMONA = "pomona"
PEERS = ("vllm-mlx", "mlx_lm.server")


@dataclass(frozen=True)
class Goal:
    name: str
    ratio: float | None  # None: a side of it was not measured in this run
    target: str  # e.g. ">= 1.3"
    detail: str

    @property
    def met(self) -> bool | None:
        if self.ratio is None or self.target.endswith("inf"):
            return None  # not measured, or a reference row with no target
        op, value = self.target.split()
        return self.ratio >= float(value) if op == ">=" else self.ratio <= float(value)


def _get(results: Mapping[str, Any], server: str, *path: str) -> float | None:
    node: Any = results.get(server)
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return float(node) if isinstance(node, (int, float)) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0.0) else None


def _fmt(x: float | None, unit: str) -> str:
    return "n/a" if x is None else f"{x:.1f} {unit}"


def throughput_goals(results: Mapping[str, Any], conc: int, target: float) -> list[Goal]:
    ours = _get(results, POMONA, "sweep", str(conc), "output_throughput")
    goals = []
    for peer in PEERS:
        theirs = _get(results, peer, "sweep", str(conc), "output_throughput")
        goals.append(Goal(f"output tok/s at concurrency {conc}: Pomona / {peer}", _ratio(ours, theirs),
                          f">= {target}", f"{_fmt(ours, 'tok/s')} vs {_fmt(theirs, 'tok/s')}"))
    return goals


def prefix_goals(results: Mapping[str, Any]) -> list[Goal]:
    ours = _get(results, POMONA, "prefix", "ttft_ms", "p50")
    goals = []
    for peer in PEERS:
        theirs = _get(results, peer, "prefix", "ttft_ms", "p50")
        goals.append(Goal(f"TTFT p50, prefix repetition: Pomona / {peer}", _ratio(ours, theirs), "<= 0.5",
                          f"{_fmt(ours, 'ms')} vs {_fmt(theirs, 'ms')}"))
    return goals


def overhead_goal(results: Mapping[str, Any], bare: Mapping[str, Any], conc: int = 16,
                  bare_after: Mapping[str, Any] | None = None) -> Goal:
    """HTTP / bare. With `bare_after` (the bare loop rerun right after Pomona's run), the bare figure
    is the mean of the runs bracketing Pomona, so load drift on a shared machine shows and averages."""
    http = _get(results, POMONA, "sweep", str(conc), "output_throughput")
    runs = [x for x in (_get({"b": bare}, "b", str(conc), "output_throughput"),
                        _get({"b": bare_after or {}}, "b", str(conc), "output_throughput")) if x is not None]
    loop = sum(runs) / len(runs) if runs else None
    detail = f"{_fmt(http, 'tok/s')} vs {_fmt(loop, 'tok/s')}"
    if len(runs) > 1:
        detail += f" (bare before / after Pomona: {runs[0]:.1f} / {runs[1]:.1f})"
    return Goal(f"serving overhead: Pomona HTTP / bare BatchGenerator loop, concurrency {conc}",
                _ratio(http, loop), ">= 0.9", detail)


def multiturn_goals(results: Mapping[str, Any]) -> list[Goal]:
    goals = []
    for server in (POMONA, *PEERS):
        by_turn = (results.get(server) or {}).get("multiturn", {}).get("ttft_p50_ms_by_turn") or {}
        if not by_turn:
            continue
        last = str(max(int(t) for t in by_turn))
        first, final = by_turn.get("0"), by_turn.get(last)
        target = "<= 1.2" if server == POMONA else "<= inf"  # peers shown for reference only
        goals.append(Goal(f"multi-turn TTFT p50, turn {int(last) + 1} / turn 1 ({server})",
                          _ratio(final, first), target, f"{_fmt(final, 'ms')} vs {_fmt(first, 'ms')}"))
    return goals


def all_goals(results: Mapping[str, Any], bare: Mapping[str, Any],
              bare_after: Mapping[str, Any] | None = None) -> list[Goal]:
    return [*throughput_goals(results, 8, 1.3), *throughput_goals(results, 32, 1.5), *prefix_goals(results),
            overhead_goal(results, bare, bare_after=bare_after), *multiturn_goals(results)]


def goals_table(goals: list[Goal]) -> str:
    from benchmarks.harness.report import markdown_table

    rows = []
    for g in goals:
        met = {True: "yes", False: "**no**", None: "—"}[g.met]
        target = "(reference)" if g.target.endswith("inf") else g.target
        rows.append([g.name, "n/a" if g.ratio is None else f"{g.ratio:.2f}", target, met, g.detail])
    return markdown_table(["goal", "ratio", "target", "met", "measured"], rows)
