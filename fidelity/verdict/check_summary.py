"""The table `fidelity check` gates, whichever command wrote the report: one row per arm
with the outcome (KLD mean / p99 / at the answer, decode KLD, same top-1) and the
mechanism (worst indexer top-k recall, needle entry lost, expert agreement), which arms
are floors, and each arm's indexer top-k recall per CSA layer. `fidelity ab` writes the
row table itself (summary.csv); a `fidelity kld` report holds the same numbers in its own
tables (kld_by_position, ladder_summary, signal_summary, the manifest's arm roles), so one
gate reads both instead of a kld report being refused."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd


class ReportError(ValueError):
    """A path that holds no report `fidelity check` can read."""


@dataclass
class GateTable:
    kind: str                                   # "ab" or "kld"
    source: Path                                # the file the rows come from (for messages)
    summary: pd.DataFrame                       # one row per arm, ab's summary.csv columns
    floors: list[str]                           # the arms that are noise floors
    recall: Callable[[str], pd.Series]          # arm -> top-k recall per CSA layer (prefill)


def read_report(path) -> GateTable:
    root = Path(path)
    if root.suffix == ".csv":
        return _ab(root)
    if (root / "summary.csv").is_file():
        return _ab(root / "summary.csv")
    if (root / "kld_by_position.csv").is_file() and (root / "manifest.json").is_file():
        return _kld(root)
    raise ReportError(f"{root} is not a `fidelity ab` or `fidelity kld` report (no summary.csv, "
                      "no kld_by_position.csv with manifest.json)")


def _ab(summary_csv: Path) -> GateTable:
    if not summary_csv.is_file():
        raise ReportError(f"no {summary_csv}")
    summary = pd.read_csv(summary_csv)
    floors = [a for a in summary.arm.astype(str) if a.startswith("floor:")]

    def recall(arm: str) -> pd.Series:
        drift = pd.read_csv(summary_csv.parent / "drift.csv.gz")
        d = drift[(drift.tap == "attn.index.topk") & (drift.bucket == "all") & (drift.phase == "prefill")]
        return d[d.arm == arm].groupby("layer")["recall"].mean()
    return GateTable("ab", summary_csv, summary, floors, recall)


def _kld(root: Path) -> GateTable:
    """ab's summary columns from a kld report: KLD statistics over all prefill positions,
    the decode ladder's mean KLD as decode KLD, and the worst place of each verdict signal."""
    m = json.loads((root / "manifest.json").read_text())["manifest"]
    floors = [a["name"] for a in m["arms"] if a.get("role") == "floor"]
    by_pos = pd.read_csv(root / "kld_by_position.csv")
    allpos = by_pos[by_pos.bucket == "all"].set_index("arm")
    ladder = _csv(root / "ladder_summary.csv").set_index("arm") if (root / "ladder_summary.csv").is_file() \
        else pd.DataFrame()
    sig = _csv(root / "signal_summary.csv")
    rows = []
    for arm, r in allpos.iterrows():
        worst = sig[sig.arm == arm].groupby("signal")["mean"].max() if len(sig) else pd.Series(dtype=float)
        rows.append({"arm": arm, "kld_mean": r.kld_mean, "kld_p99": r.kld_p99, "kld_max": r.kld_max,
                     "same_top1": r.same_top1, "dp_mean": r.dp_mean,
                     "decode_kld_mean": ladder.ladder_kld_mean.get(arm, np.nan) if len(ladder) else np.nan,
                     "answer_kld": worst.get("answer_kld", np.nan),
                     "late_kld_excess": worst.get("late_kld_excess", np.nan),
                     "topk_recall_min": 1 - worst.get("topk_loss", np.nan),
                     "needle_lost_max": worst.get("needle_lost", np.nan),
                     "expert_same_min": 1 - worst.get("expert_disagree", np.nan)})

    def recall(arm: str) -> pd.Series:
        t = sig[(sig.arm == arm) & (sig.signal == "topk_loss")]
        layers = t["where"].str.extract(r"layer (\d+)", expand=False).astype(int)
        return pd.Series(1 - t["mean"].to_numpy(), index=layers.to_numpy())
    return GateTable("kld", root / "kld_by_position.csv", pd.DataFrame(rows), floors, recall)


def _csv(path: Path) -> pd.DataFrame:
    """A report table; an empty file (no rows were written) as an empty frame."""
    try:
        return pd.read_csv(path)
    except (FileNotFoundError, pd.errors.EmptyDataError):
        return pd.DataFrame(columns=["arm", "signal", "where", "mean"])
