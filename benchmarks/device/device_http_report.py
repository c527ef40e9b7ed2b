"""One table from a side_by_side results.json with the in-process engine (benchmarks/device/device_http.sh).

    python -m benchmarks.device.device_http_report side-1b.json [more.json ...]

Per concurrency: output tokens/s of the bare loop, Pomona's engine in process, each server over
HTTP; Pomona HTTP / engine in process and Pomona / mlx_lm.server; TPOT p50 (per request: time after
the first token over the tokens after it) and the gap between SSE chunks p50 (what the client sees
between writes: several tokens a chunk once streams are paced); TTFT p50.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence


def _tok(block: dict[str, Any] | None) -> float | None:
    return None if not block else block.get("output_throughput")


def _fmt(x: float | None, digits: int = 0) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "—" if not a or not b else f"{a / b:.2f}"


def rows(data: dict[str, Any]) -> list[str]:
    bare, engine = data.get("bare_loop") or {}, data.get("engine_in_process") or {}
    servers = {k: v.get("sweep") or {} for k, v in data["servers"].items()}
    names = list(servers)
    head = (["c", "bare tok/s", "engine tok/s"] + [f"{n} tok/s" for n in names]
            + ["Pomona/engine", "Pomona/mlx_lm"] + [f"{n} TPOT p50 / chunk gap p50 ms" for n in names]
            + ["engine gap p50 ms"] + [f"{n} TTFT p50 ms" for n in names])
    out = ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
    levels = sorted({int(c) for s in servers.values() for c in s} | {int(c) for c in engine})
    for c in levels:
        key = str(c)
        http = {n: servers[n].get(key) for n in names}
        pom, mlx = _tok(http.get("pomona")), _tok(http.get("mlx_lm.server"))
        cells = [key, _fmt(_tok(bare.get(key))), _fmt(_tok(engine.get(key)))]
        cells += [_fmt(_tok(http[n])) for n in names]
        cells += [_ratio(pom, _tok(engine.get(key))), _ratio(pom, mlx)]
        cells += ["—" if not http[n] else f"{http[n]['tpot_ms']['p50']:.2f} / {http[n]['itl_ms']['p50']:.2f}"
                  for n in names]
        cells.append(_fmt((engine.get(key) or {}).get("itl_ms_p50"), 2))
        cells += ["—" if not http[n] else _fmt(http[n]["ttft_ms"]["p50"]) for n in names]
        out.append("| " + " | ".join(cells) + " |")
    failed = [f"{k}: {str(v.get('failed') or v.get('skipped'))[-400:]}" for k, v in data["servers"].items()
              if "failed" in v or "skipped" in v]
    return out + failed + [""] + step_rows(engine, servers.get("pomona") or {}, levels)


def step_rows(engine: dict[str, Any], pomona: dict[str, Any], levels: Sequence[int]) -> list[str]:
    """The engine's own step accounting (benchmarks/harness/step_report.py), in process and behind Serve."""
    fields = ("steps_per_s", "ms_per_step", "step_cpu_ms", "tokens_per_step", "prompt_tokens_per_step",
              "deliver_ms_per_step", "busy_share")
    head = ["c", "where"] + [f.replace("_", " ") for f in fields]
    out = ["| " + " | ".join(head) + " |", "| ---: | --- |" + " ---: |" * len(fields)]
    for c in levels:
        for where, block in (("in process", engine.get(str(c))), ("over HTTP", pomona.get(str(c)))):
            steps = (block or {}).get("engine_steps")
            if steps:
                out.append("| " + " | ".join([str(c), where] + [f"{steps[f]:,.3g}" for f in fields]) + " |")
    return out if len(out) > 2 else []


def main(argv: Sequence[str] | None = None) -> int:
    for path in argv if argv is not None else sys.argv[1:]:
        data = json.loads(Path(path).read_text())
        print(f"{path}: {data.get('model_dir')}")
        print("\n".join(rows(data)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
