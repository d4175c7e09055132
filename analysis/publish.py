"""What every publisher of analysis/ shares, at the bottom of the floor (it imports no other
module of analysis/): Markdown tables, the provenance of a study's numbers and the listing of
the files a tool wrote."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd

from ced.records import DamagedRecord, read_json
from ced.run_id import identified


def provenance(study: Path) -> dict:
    """Where the numbers come from, from the driver's summary.json: the study, scale, seeds
    (those of its runs; summary.json's where it has none), every invocation (command, git
    commit, whether the tree was dirty, wall time) and the seconds spent per kind of step
    (train / divergence / suite), summed over the steps that ran (a skipped or reused step
    keeps the seconds of the invocation that ran it)."""
    try:
        record = read_json(study / "summary.json")
    except DamagedRecord as exc:
        print(f"[findings] warning: {exc}; the provenance (commands, commits, step times) is "
              "unknown; rerun the study driver on the study to set it aside and rebuild it",
              file=sys.stderr)
        return {"damaged": str(exc)}
    if record is None:
        return {}
    seconds: dict[str, float] = {}
    for key, step in record.get("steps", {}).items():
        if "seconds" in step:
            kind = key.split("/", 1)[0].split(" ", 1)[0]
            seconds[kind] = seconds.get(kind, 0.0) + float(step["seconds"])
    return {"study": record.get("study"), "scale": record.get("scale"),
            "seeds": _trained_seeds(study) or record.get("seeds"),
            "invocations": record.get("invocations", []),
            "step_seconds": {k: round(v, 1) for k, v in sorted(seconds.items())},
            "total_step_seconds": round(sum(seconds.values()), 1)}


def _trained_seeds(study: Path) -> list[int]:
    """The seeds of the study's runs (runs/<job>/seed<k>, with or without a final model):
    summary.json's `seeds` are only those of the driver's last invocation, which may have
    trained one model of a study grown over many."""
    return sorted({run_id.seed for run_id, _ in identified(study / "runs")})


def provenance_markdown(info: dict) -> list[str]:
    """The provenance of `provenance(study)` as Markdown lines: study, scale, seeds, step time
    and a table of the invocations (command, commit, tree, wall time)."""
    if not info:
        return ["(no summary.json in the study directory: command and commit unknown)", ""]
    if "damaged" in info:
        return [f"(summary.json is damaged, so command and commit are unknown: "
                f"{info['damaged']})", ""]
    lines = [f"Study `{info['study']}`, scale `{info['scale']}`, seeds {info['seeds']}. "
             f"Step time: {info['total_step_seconds'] / 60:.1f} min on this machine "
             f"({', '.join(f'{k} {v / 60:.1f} min' for k, v in info['step_seconds'].items())}).",
             "", "| command | commit | tree | wall time |", "|---|---|---|---|"]
    for run in info["invocations"]:
        commit = (run.get("commit") or "unknown")[:10]
        tree = "dirty" if run.get("dirty") else "clean" if run.get("commit") else "?"
        lines.append(f"| `{run.get('command', '?')}` | {commit} | {tree} | "
                     f"{float(run.get('elapsed_s', 0)) / 60:.1f} min |")
    return lines + [""]


def markdown(table: pd.DataFrame, columns: list[str], digits: int = 3) -> str:
    """`columns` of `table` as a Markdown table, floats to `digits` places (tiny ones in
    significant digits); "(none)" for an empty table."""
    if table.empty:
        return "(none)\n"
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for rec in table[columns].to_dict("records"):
        cells = []
        for col in columns:
            v = rec[col]
            if isinstance(v, float):
                cells.append("" if math.isnan(v) else f"{v:.{digits}g}" if abs(v) < 1e-3 and v
                             else f"{v:.{digits}f}")
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


