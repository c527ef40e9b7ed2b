"""The agent-workload goals (issue 31) as ratios, from the results of `benchmarks/device/device_http.sh`'s
agent, reuse and ssd parts (any of them; a missing file leaves its goals "not measured").

    python -m benchmarks.device.device_goals --agent agent-smollm2.json --reuse reuse-smollm2.json --ssd ssd-smollm2.json
    python -m benchmarks.device.device_goals --dir $OUT          # the files device_http.sh writes there, by name
    python -m benchmarks.device.device_goals --ssd ssd.json --only-given   # only that part's goals

- agent (benchmarks/agent/agent_session.py results): session time, TTFT of turn 1, TTFT of turns 2-10
  (median and max of the per-turn ratios), each Pomona / mlx_lm.server.
- reuse (benchmarks/harness/side_by_side.py results, parts prefix and multiturn): multi-turn TTFT p50
  Pomona / mlx_lm.server, Pomona's multi-turn turn 8 / turn 1 TTFT p50, prefix TTFT p50 ratio.
- ssd (benchmarks/engine/ssd_growth.py results): SSD bytes / the conversation's final KV size; the decoding
  streams' chunk gaps while a long turn is persisted, p99 and max over the baseline's p50 (reference).
Pure functions of the JSON; prints a goals table (benchmarks.harness.goals.goals_table).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

from benchmarks.harness.goals import Goal, goals_table

OURS, PEER = "pomona", "mlx_lm.server"
PARTS = ("agent", "reuse", "ssd")  # device_http.sh writes $OUT/<part>-<shape>.json


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f} ms"


def _turn_ttfts(data: Mapping[str, Any], server: str) -> dict[int, float]:
    turns = ((data.get("servers") or {}).get(server) or {}).get("turns") or []
    return {t["turn"]: t["ttft_s"] * 1000 for t in turns if t.get("ok")}


def agent_goals(data: Mapping[str, Any] | None) -> list[Goal]:
    data = data or {}
    n = len(data.get("expected_prompt_tokens") or [])
    ours, peer = _turn_ttfts(data, OURS), _turn_ttfts(data, PEER)
    servers = data.get("servers") or {}

    def session(server: str) -> float | None:
        s = servers.get(server) or {}
        complete = n and len(_turn_ttfts(data, server)) == n
        return s.get("session_s") if complete else None
    s_ours, s_peer = session(OURS), session(PEER)
    later = {k: _ratio(ours.get(k), peer.get(k)) for k in range(2, n + 1)}
    measured = [r for r in later.values() if r is not None]
    complete = bool(measured) and len(measured) == len(later)
    median = statistics.median(measured) if complete else None
    worst = max(measured) if complete else None
    worst_turn = max((k for k, r in later.items() if r is not None), key=lambda k: later[k], default=None)
    ours_later = [ours[k] for k in later if k in ours]
    detail_later = (f"Pomona {_ms(min(ours_later, default=None))} to {_ms(max(ours_later, default=None))}, "
                    f"per-turn ratios {', '.join('n/a' if r is None else f'{r:.2f}' for r in later.values()) or 'n/a'}")
    return [
        Goal("agent session time: Pomona / mlx_lm.server", _ratio(s_ours, s_peer), "<= 0.6",
             " vs ".join("n/a" if s is None else f"{s:.1f} s" for s in (s_ours, s_peer))),
        Goal("agent TTFT turn 1 (cold): Pomona / mlx_lm.server", _ratio(ours.get(1), peer.get(1)), "<= 0.6",
             f"{_ms(ours.get(1))} vs {_ms(peer.get(1))}"),
        Goal(f"agent TTFT turns 2-{n or 10}: median of Pomona / mlx_lm.server", median, "<= 0.5", detail_later),
        Goal(f"agent TTFT turns 2-{n or 10}: max of Pomona / mlx_lm.server", worst, "<= 0.8",
             "n/a" if worst_turn is None or worst is None else
             f"turn {worst_turn}: {_ms(ours.get(worst_turn))} vs {_ms(peer.get(worst_turn))}"),
    ]


def _get(data: Mapping[str, Any], *path: str) -> Any:
    node: Any = data
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def reuse_goals(data: Mapping[str, Any] | None) -> list[Goal]:
    servers = (data or {}).get("servers") or {}
    mt_ours, mt_peer = (_get(servers, s, "multiturn", "ttft_ms", "p50") for s in (OURS, PEER))
    by_turn = _get(servers, OURS, "multiturn", "ttft_p50_ms_by_turn") or {}
    last = str(max((int(t) for t in by_turn), default=7))  # the suite's 8 turns, numbered from 0
    first, final = by_turn.get("0"), by_turn.get(last) if by_turn else None
    px_ours, px_peer = (_get(servers, s, "prefix", "ttft_ms", "p50") for s in (OURS, PEER))
    return [
        Goal("multi-turn TTFT p50: Pomona / mlx_lm.server", _ratio(mt_ours, mt_peer), "<= 0.7",
             f"{_ms(mt_ours)} vs {_ms(mt_peer)}"),
        Goal(f"multi-turn TTFT p50, Pomona turn {int(last) + 1} / turn 1", _ratio(final, first), "<= 1.2",
             f"{_ms(final)} vs {_ms(first)}"),
        Goal("prefix TTFT p50: Pomona / mlx_lm.server", _ratio(px_ours, px_peer), "<= 0.5",
             f"{_ms(px_ours)} vs {_ms(px_peer)}"),
    ]


def ssd_goals(data: Mapping[str, Any] | None) -> list[Goal]:
    data = data or {}
    growth = data.get("growth") or {}
    tokens, ssd_bytes = growth.get("final_conversation_tokens"), growth.get("final_ssd_bytes")
    out = [Goal("SSD bytes / final KV size of a growing conversation", growth.get("final_ratio"), "<= 1.5",
                "n/a" if tokens is None or ssd_bytes is None else
                f"{ssd_bytes / 1e6:.1f} MB for {tokens} tokens x {growth.get('kv_bytes_per_token'):,} B "
                f"({data.get('kv_dtype')})")]
    gaps = data.get("gaps") or {}
    windows = gaps.get("windows") or {}
    base = _get(windows, "baseline", "p50_ms")
    persist = windows.get("persist") or {}
    where = "n/a" if not gaps else (
        f"{gaps.get('streams')} streams, a {gaps.get('long_prompt_tokens')}-token turn; "
        f"window {gaps.get('persist_window_s', 0):.1f} s, its final flush {gaps.get('flush_s', 0):.2f} s")
    for stat in ("p99", "max"):
        x = persist.get(f"{stat}_ms")
        out.append(Goal(f"chunk gap {stat} while a long turn is persisted / baseline p50 (reference)",
                        _ratio(x, base), "<= inf", f"{_ms(x)} vs {_ms(base)}; {where}"))
    return out


def all_goals(agent: Mapping[str, Any] | None, reuse: Mapping[str, Any] | None,
              ssd: Mapping[str, Any] | None, only_given: bool = False) -> list[Goal]:
    """Every goal; `only_given`: only those of the parts whose results were given."""
    parts = ((agent, agent_goals), (reuse, reuse_goals), (ssd, ssd_goals))
    return [g for data, goals in parts if data is not None or not only_given for g in goals(data)]


def _load(path: str | Path | None) -> dict[str, Any] | None:
    if not path or not Path(path).exists():
        return None
    return json.loads(Path(path).read_text())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="read <part>-<shape>.json of each part from here")
    p.add_argument("--shape", default="smollm2",
                   help="the model shape in the file names (device_http.sh's AGENT_SHAPE)")
    for part in PARTS:
        p.add_argument(f"--{part}", default=None, help=f"results JSON of the {part} part")
    p.add_argument("--only-given", action="store_true", help="leave out the goals of parts without results")
    args = p.parse_args(argv)
    paths = {part: getattr(args, part) or (Path(args.dir) / f"{part}-{args.shape}.json" if args.dir else None)
             for part in PARTS}
    loaded = {part: _load(path) for part, path in paths.items()}
    print("files: " + ", ".join(f"{part} {paths[part] if loaded[part] else '(none)'}" for part in PARTS))
    goals = all_goals(loaded["agent"], loaded["reuse"], loaded["ssd"], args.only_given)
    print(goals_table(goals))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
