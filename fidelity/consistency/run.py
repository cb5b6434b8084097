"""`fidelity consistency`: probe each live endpoint under serving conditions, judge every
condition against the arm's own floor, write the report. Finished probes go to
<out>/consistency/probes.jsonl as they finish (resume by default); the report is written
from all of them."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

from fidelity import servers
from fidelity.kld.identity import check_live

from .batch import BatchFamily, BatchPlan
from .chunk import ChunkFamily, ChunkPlan
from .client import LiveArm
from .family import FamilyError
from .judge import cache_reruns, condition_table, longgen_lines, longgen_table, rerun_lines, verdict_lines
from .longgen import LongGenFamily, LongGenPlan
from .prefix import PrefixFamily, PrefixPlan
from .spec import SpecFamily, SpecPlan, compared, specials
from .spec_judge import spec_lines, spec_table
from .specials import leaked, special_counts, special_lines
from .store import ProbeStore

# family -> its runner: (arm, store, tokenizer, cfg, plan, reference), run(progress),
# key_prefix(arm, plan); `reference` (a scorer computed here) is what chunk and longgen
# compare with
FAMILIES = {"prefix": PrefixFamily, "batch": BatchFamily, "chunk": ChunkFamily, "longgen": LongGenFamily,
            "spec": SpecFamily}


@dataclass(frozen=True)
class ConsistencySettings:
    families: tuple[str, ...] = tuple(FAMILIES)
    prefix: PrefixPlan = field(default_factory=PrefixPlan)
    batch: BatchPlan = field(default_factory=BatchPlan)
    chunk: ChunkPlan = field(default_factory=ChunkPlan)
    longgen: LongGenPlan = field(default_factory=LongGenPlan)
    spec: SpecPlan = field(default_factory=SpecPlan)

    def plan(self, family: str):
        return getattr(self, family)


def store_path(out_dir) -> Path:
    return Path(out_dir) / "consistency" / "probes.jsonl"


def run_consistency(arms: list[LiveArm], target, settings: ConsistencySettings, out_dir,
                    run_id: str | None = None, progress=print, reference=None,
                    identity: bool = False) -> dict:
    """Probe every arm with every family (connect() done here), then judge and report.
    `reference`: a scorer computed here (kld's InProcessScorer) for the families that
    compare with one. `identity`: first ask whether each arm serves `target`'s model -- only
    when the user named the model (--checkpoint or a reference arm): consistency compares an
    engine with itself and otherwise needs the checkpoint's tokenizer alone."""
    unknown = sorted(set(settings.families) - set(FAMILIES))
    if unknown:
        raise ValueError(f"unknown probe family {', '.join(unknown)} (known: {', '.join(FAMILIES)})")
    t0 = time.time()
    store = ProbeStore(store_path(out_dir))
    for arm in arms:
        arm.connect()
    runs = [[FAMILIES[name](arm, store, target.tokenizer, target.cfg, settings.plan(name), reference)
             for name in settings.families] for arm in arms]
    names = {a.name for a in arms}
    for fam in (f for fams in runs for f in fams if isinstance(f, SpecFamily)):
        fam.baseline_live = settings.spec.baseline in names        # else recorded by an earlier run
    planned = _preflight(runs, progress)
    if identity:                                             # another model: exit 2, nothing probed
        check_live([a.ep for a in arms], target, reference)
    say = with_totals(progress, arms, planned, time.monotonic())
    described = []
    for arm, fams in zip(arms, runs):
        described.append({**arm.ep.describe(), **arm.sizes()})
        for fam in fams:
            fam.run(say)
            if fam.name == "prefix":
                described[-1]["cold_by"] = fam.flush_route or "two random leading tokens (no flush route)"
        described[-1]["retries"] = dict(arm.ep.retries)
    plain = {f.arm.name: f.not_speculating() for fams in runs for f in fams
             if isinstance(f, SpecFamily) and f.not_speculating()}
    current = [r for r in store.rows if _current(r, settings)]
    recorded = [r for r in current if r["family"] == "spec" and r["arm"] not in plain
                and r["arm"] in names | {settings.spec.baseline}]
    spec_rows = pd.DataFrame([r for r in compared(recorded, settings.spec.baseline, specials(target.tokenizer))
                              if r["arm"] in names])
    kept = [r for r in current if r["arm"] in names and r["family"] != "spec"]
    rows = pd.DataFrame(kept) if kept else pd.DataFrame(columns=["key", "family", "arm", "probe", "condition"])
    for d in described:
        d["cache_reruns"] = cache_reruns(rows, d["name"])
    table = condition_table(rows)
    behaviour = longgen_table(rows, table)          # the one judgement of long generations
    spec = spec_table(spec_rows)                    # the one judgement of speculation on vs off
    tok = target.tokenizer
    leaks = special_counts(rows, getattr(tok, "bos_id", None), getattr(tok, "eos_id", None))
    result = {"manifest": {"arms": described, "settings": asdict(settings), "checkpoint": target.name,
                           "reference": reference.describe() if reference is not None else None,
                           "seconds": round(time.time() - t0, 1),
                           "requests": _requests(pd.DataFrame([r for r in current if r["arm"] in names]))},
              "verdict": special_lines(leaks) + verdict_lines(table) + rerun_lines(rows) + longgen_lines(behaviour)
              + spec_lines(spec) + [f"`{a}` does not decode speculatively ({how}): left out of the spec "
                                    "family, which compares speculating arms with the baseline"
                                    for a, how in plain.items()] + _dialect_caveats(described),
              "conditions": table,
              "behaviour": behaviour, "spec": spec, "specials": leaks,
              "probes": pd.concat([rows, spec_rows]) if len(spec_rows) else rows,
              "flagged": bool(table.flagged.any() or (len(behaviour) and behaviour.flagged.any())
                              or (len(spec) and spec.flagged.any()) or leaked(leaks))}
    if out_dir is not None:
        from .report import write_report
        result["path"] = str(write_report(Path(out_dir) / "consistency",
                                          run_id or time.strftime("consistency-%Y%m%d-%H%M%S"), result))
    return result


def with_totals(progress, arms: list[LiveArm], planned: int, t0: float):
    """`progress` with the whole run's count on every line: requests sent so far of those
    planned, the time since the first and an ETA at the rate so far, so a family that runs
    for minutes says where the run stands. The plan counts every request, the count only
    those sent (probes stored by an earlier run are not sent again): an estimate, said as one."""
    def say(msg: str) -> None:
        done, el = sum(a.sent for a in arms), time.monotonic() - t0
        eta = f", eta ~{el / done * (planned - done):.0f} s" if 0 < done < planned else ""
        progress(f"{msg} [{done}/{planned} requests, {el:.0f} s{eta}]")
    return say


def _preflight(runs: list[list], progress) -> int:
    """Before any probe request: every family checked on every arm (one FamilyError naming
    each that cannot run as asked, and the option to change), then what each arm will be
    sent, said; returns the requests planned in all."""
    errors = []
    for fams in runs:
        for fam in fams:
            try:
                fam.check()
            except FamilyError as e:
                errors.append(f"{fam.arm.name}: {e}" if len(runs) > 1 else str(e))
    if errors:
        raise FamilyError("; ".join(dict.fromkeys(errors)))
    planned = 0
    for fams in filter(None, runs):
        costs = [(fam.name, fam.cost()) for fam in fams]
        total = sum(c.requests for _, c in costs)
        planned += total
        progress(f"plan: {fams[0].arm.name}: " + "; ".join(c.words(n) for n, c in costs)
                 + f"; {total} requests in all (fewer when probes are stored)")
    return planned


def _dialect_caveats(described: list[dict]) -> list[str]:
    """What an arm read through plain OpenAI completions cannot show, said in the verdict."""
    found = [(a["name"], servers.find(a.get("dialect"))) for a in described]
    return [f"`{name}` {s.caveat}" for name, s in found if s and s.caveat]


def _current(row: dict, s: ConsistencySettings) -> bool:
    """A stored probe of this run's families and plans (the key carries the plan's settings)."""
    fam = row["family"]
    if fam not in s.families:
        return False
    plan = s.plan(fam)
    return row["key"].startswith(FAMILIES[fam].key_prefix(row["arm"], plan)) and int(row["probe"]) < plan.probes


def _requests(rows: pd.DataFrame) -> dict:
    """Requests sent per family and arm (each stored probe row says how many it sent;
    flushes and the reference's own scoring are not requests to the engine)."""
    if rows.empty or "requests" not in rows:
        return {}
    per = rows.groupby(["family", "arm"]).requests.sum()
    return {f"{fam}/{arm}": int(v) for (fam, arm), v in per.items()}
