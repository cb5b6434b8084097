"""`fidelity consistency`: probe each live endpoint under serving conditions, judge every
condition against the arm's own floor, write the report. Finished probes go to
<out>/consistency/probes.jsonl as they finish (resume by default); the report is written
from all of them."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

from .client import LiveArm
from .judge import condition_table, verdict_lines
from .prefix import PrefixFamily, PrefixPlan
from .store import ProbeStore

FAMILIES = ("prefix",)


@dataclass(frozen=True)
class ConsistencySettings:
    families: tuple[str, ...] = FAMILIES
    prefix: PrefixPlan = field(default_factory=PrefixPlan)


def store_path(out_dir) -> Path:
    return Path(out_dir) / "consistency" / "probes.jsonl"


def run_consistency(arms: list[LiveArm], target, settings: ConsistencySettings, out_dir,
                    run_id: str | None = None, progress=print) -> dict:
    """Probe every arm with every family (connect() done here), then judge and report."""
    unknown = sorted(set(settings.families) - set(FAMILIES))
    if unknown:
        raise ValueError(f"unknown probe family {', '.join(unknown)} (known: {', '.join(FAMILIES)})")
    t0 = time.time()
    store = ProbeStore(store_path(out_dir))
    described = []
    for arm in arms:
        arm.connect()
        described.append({**arm.ep.describe(), **arm.sizes(), "retries": dict(arm.ep.retries)})
        if "prefix" in settings.families:
            fam = PrefixFamily(arm, store, target.tokenizer, target.cfg, settings.prefix)
            fam.run(progress)
            described[-1]["cold_by"] = fam.flush_route or "two random leading tokens (no flush route)"
        described[-1]["retries"] = dict(arm.ep.retries)
    names = {a.name for a in arms}
    rows = pd.DataFrame([r for r in store.rows if r.get("arm") in names and _current(r, settings)])
    table = condition_table(rows)
    result = {"manifest": {"arms": described, "settings": asdict(settings), "checkpoint": target.name,
                           "seconds": round(time.time() - t0, 1), "requests": _requests(rows, settings)},
              "verdict": verdict_lines(table), "conditions": table, "probes": rows}
    if out_dir is not None:
        from .report import write_report
        result["path"] = str(write_report(Path(out_dir) / "consistency",
                                          run_id or time.strftime("consistency-%Y%m%d-%H%M%S"), result))
    return result


def _current(row: dict, s: ConsistencySettings) -> bool:
    """A stored probe of this run's plan (the key carries the plan's settings)."""
    p = s.prefix
    return row["key"].startswith(f"{row['family']}|{row['arm']}|L{p.length}|s{p.seed}|n{p.max_tokens}|k{p.k}|") \
        and int(row["probe"]) < p.probes


def _requests(rows: pd.DataFrame, s: ConsistencySettings) -> dict:
    """Requests per family and arm: a measured condition sends 1 (floor) or 2 (hits), a
    reference 1; flushes not counted."""
    if rows.empty:
        return {}
    per = rows.condition.map(lambda c: 1 if c in ("cold", "cold-again") else 2)
    return {f"{fam}/{arm}": int(n) for (fam, arm), n in per.groupby([rows.family, rows.arm]).sum().items()}
