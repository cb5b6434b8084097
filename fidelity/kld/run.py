"""Logit-level A/B over HTTP: score every prompt on every arm (resumable), compare each arm
with the baseline position by position, and judge the arms with the same signals,
floors, attribution and verdict as `fidelity ab` (fidelity.verdict.judge). The one KLD
orchestration: `fidelity kld` scores then evaluates (run_kld); `fidelity engines` scores
arm by arm while each engine is up (score_entry), then evaluates the same way.

Floors: when the baseline runs in-process, `fidelity ab`'s three floor arms (exact,
fp32-accum, tie-order) run in-process too; when it is an endpoint, the baseline is scored
a second time (`<baseline>~repeat`: the engine's run-to-run noise) and any arm given
role "floor" counts as well."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from fidelity import servers
from fidelity.progress import Progress
from fidelity.design.prompts import describe
from fidelity.verdict.judge import Bootstrap, Design, judge
from fidelity.verdict.signals import http_signals

from . import health as H
from . import report
from .compare import capture_rows, position_rows
from fidelity.scores.dialects import PromptScores, Request
from .margins import margin_rows
from .settings import KldSettings
from fidelity.scores.store import ScoreStore, request_key

REPEAT_SUFFIX = "~repeat"


@dataclass
class ScoredArm:
    """An arm as the KLD run sees it: the scorer (Endpoint or InProcessScorer; None when
    only its stored scores are read), its role and the factors attribution credits
    (toggles, patches; its own name by default)."""
    name: str
    scorer: object
    role: str = "arm"               # baseline | arm | floor | twin (compared, not judged)
    factors: frozenset = field(default_factory=frozenset)
    against: str | None = None      # compared with this arm's scores, not the baseline's (an
                                    # engine scored again and compared with itself: its own noise)


def arm_record(e: ScoredArm) -> dict:
    """An arm as a manifest keeps it: its scorer's own view, name, role, factors (and what
    it is compared with when not the baseline; an arm read from stored scores alone, as
    `fidelity engines`' report reads them, has no scorer to describe)."""
    return {**(e.scorer.describe() if e.scorer is not None else {}), "name": e.name, "role": e.role, "factors": sorted(e.factors),
            **({"against": e.against} if e.against else {})}


def repeat_floor(base: ScoredArm) -> ScoredArm:
    """The baseline scored a second time by the same scorer: its run-to-run noise, a floor."""
    return ScoredArm(f"{base.name}{REPEAT_SUFFIX}", base.scorer, "floor")


# roles whose scores are read as a baseline's (no exact-mode extra ids): a twin is the
# baseline of its own judgement and context in the golden's, stored once under one key
BASE_ROLES = ("baseline", "twin")


def _request(s: KldSettings, entry: ScoredArm, base: PromptScores | None) -> Request:
    r = Request(k=s.k, steps=s.steps, captures=s.captures)
    server = servers.find(getattr(entry.scorer, "dialect", None))
    exact = server.exact if server else None
    if s.exact and base is not None and entry.role not in BASE_ROLES:
        if exact == "score_ids":                    # the ids the baseline ranks highest, scored everywhere
            top = set()
            for kn in base.known + base.ladder:
                top.update(kn.ids[np.argsort(-kn.logp)[:s.exact_k]].tolist())
            r.score_ids = tuple(sorted(top))
        elif exact == "full_vocab":
            r.full_vocab = True
    return r


def score_key(s: KldSettings, entry: ScoredArm, ids: list[int]) -> str:
    """The key an arm's scores of a prompt are stored under (score_arm writes it; engines read
    the baseline's scores back by it)."""
    return request_key(s.k, s.steps, s.exact and entry.role not in BASE_ROLES, s.captures, ids)


def score_arm(entry: ScoredArm, prompts, s: KldSettings, store: ScoreStore, baseline: str | None,
              progress: Progress) -> int:
    """Score the prompts this arm has not scored yet, or scored without the captures it
    should have returned (resume fills the gap); returns how many were scored."""
    def pending(p):
        got = store.get(entry.name, p.id, score_key(s, entry, p.tokens.tolist()))
        return (got is None or got.captures_missing is not None
                or (s.captures and got.indexer is None and entry.scorer.kind == "endpoint"
                    and getattr(entry.scorer, "shape", None) is not None)
                # stored before in-process scores kept the indexer's last score row
                or (s.captures and got.index_scores is None and entry.scorer.kind == "inprocess"))
    todo = [p for p in prompts if pending(p)]
    with progress.task(f"scoring {entry.name}", len(todo)) as advance:
        for p in todo:
            _score_one(entry, p, s, store, baseline)
            advance(1, p.id)
    # captures learnt of mid-run (their shape arrived late): ask once more for those before
    again = [p for p in todo if pending(p) and store.get(entry.name, p.id, score_key(s, entry, p.tokens.tolist()))
             .captures_missing is None]
    for p in again:
        _score_one(entry, p, s, store, baseline)
    return len(todo)


def _score_one(entry: ScoredArm, p, s: KldSettings, store: ScoreStore, baseline: str | None) -> None:
    ids = p.tokens.tolist()
    key = score_key(s, entry, ids)
    base = None
    if s.exact and entry.role not in BASE_ROLES and baseline is not None:
        base = store.get(baseline, p.id, request_key(s.k, s.steps, False, s.captures, ids))
        if base is None:
            raise RuntimeError(f"exact mode: the baseline {baseline} has not scored {p.id} yet")
    store.put(entry.name, p.id, key, entry.scorer.score(ids, _request(s, entry, base)))


def load(entry: ScoredArm, p, s: KldSettings, store: ScoreStore) -> PromptScores:
    got = store.get(entry.name, p.id, score_key(s, entry, p.tokens.tolist()))
    if got is None:
        raise RuntimeError(f"{entry.name} has no scores for prompt {p.id}")
    return got


def compare_all(entries: list[ScoredArm], prompts, s: KldSettings, store: ScoreStore,
                shape: dict | None) -> dict[str, pd.DataFrame]:
    """Per-position rows, ladder divergence and capture rows of every arm vs the baseline,
    selection margins (the baseline's needle margin, the arm's implied perturbation: only
    when the baseline kept its indexer scores, i.e. runs in-process), and each arm's
    capture coverage (prompts each capture signal could be computed on)."""
    base_e = next(e for e in entries if e.role == "baseline")
    pos, ladder, caps, margins, cov = [], [], [], [], []
    base_bases = [load(base_e, p, s, store) for p in prompts]
    if s.captures:
        cov += H.coverage_rows(base_e.name, "baseline", base_bases, base_bases,
                               H.offers_captures(base_e.scorer, base_bases))
    named = {e.name: e for e in entries}
    for e in entries:
        if e is base_e:
            continue
        bases = base_bases if e.against is None else [load(named[e.against], p, s, store) for p in prompts]
        arms = []
        for p, base in zip(prompts, bases):
            a = load(e, p, s, store)
            arms.append(a)
            rows, first = position_rows(base, a)
            pos += [{"arm": e.name, "prompt": p.id, "group": p.group, **r} for r in rows]
            ladder.append({"arm": e.name, "prompt": p.id, "group": p.group, "steps": len(a.ladder_tokens),
                           "first_divergence": first})
            if shape:
                caps += [{"arm": e.name, "prompt": p.id, **r} for r in
                         capture_rows(base, a, shape["indexer_layers"], shape["num_hidden_layers"],
                                      p.needle_tokens, shape.get("compress_ratios"))]
                margins += [{"arm": e.name, "prompt": p.id, "group": p.group, **r} for r in
                            margin_rows(base, a, shape["indexer_layers"], shape["index_topk"],
                                        p.needle_tokens, shape.get("compress_ratios"))]
        if s.captures:
            cov += H.coverage_rows(e.name, e.role, bases, arms, H.offers_captures(e.scorer, arms))
    if s.captures and not shape:               # nothing could be read: say so per arm
        for r in cov:
            if r["prompts"]:
                r["prompts"], r["missing_because"] = 0, "the capture shape is unknown (/get_model_info)"
    return {"positions": pd.DataFrame(pos), "ladder": pd.DataFrame(ladder), "captures": pd.DataFrame(caps),
            "margins": pd.DataFrame(margins), "coverage": pd.DataFrame(cov)}


def twin_entries(twin, scorer, floors: list, engines: dict[str, ScoredArm]) -> list[ScoredArm]:
    """The second judgement's arms (fidelity.kld.twin): the twin (its in-process `scorer`) as
    baseline, its engines, the floors around the twin ((name, scorer) each, named
    `<twin>~<floor>`) and each engine
    scored again and compared with itself (its own run-to-run noise)."""
    out = [ScoredArm(twin.name, scorer, "baseline")]
    out += [ScoredArm(e, engines[e].scorer, "arm", frozenset({e})) for e in twin.engines]
    out += [ScoredArm(n, s, "floor") for n, s in floors]
    out += [ScoredArm(f"{e}{REPEAT_SUFFIX}", engines[e].scorer, "floor", against=e) for e in twin.engines]
    return out


def judge_arms(entries: list[ScoredArm], sig: pd.DataFrame, s: KldSettings, prompts=()) -> dict:
    """Summary, floors, attribution and verdict, exactly as `fidelity ab` judges its arms
    (`prompts` name the broken ones in the verdict's words)."""
    base = next(e for e in entries if e.role == "baseline")
    sets = {e.name: e.factors for e in entries if e.role == "arm"}
    factors = sorted(set().union(*sets.values())) if sets else []
    floors = [e.name for e in entries if e.role == "floor"]
    return judge(sig, Design(base.name, sets, factors, floors), Bootstrap(s.n_boot, s.seed),
                 describe=describe(prompts))


def check_identity(store: ScoreStore, entry: ScoredArm) -> None:
    """Scores kept under an arm's name must come from the same server/arm: a relaunched,
    changed engine under an old name would otherwise be compared from stale files. The URL
    is not part of that (the server's fingerprint is): the same engine relaunched on another
    port resumes; the stored record then holds the new URL."""
    desc = {k: v for k, v in entry.scorer.describe().items() if k != "dialect"}
    f = store.root / entry.name / "arm.json"
    if f.exists():
        old = json.loads(f.read_text())
        same = {k: v for k, v in old.items() if k != "url"} == {k: v for k, v in desc.items() if k != "url"}
        if not same:
            changed = sorted(k for k in set(old) | set(desc) if k != "url" and old.get(k) != desc.get(k))
            raise RuntimeError(f"scores stored for arm {entry.name!r} came from another server or arm "
                               f"({', '.join(f'{k}: {old.get(k)!r} then, {desc.get(k)!r} now' for k in changed)}); "
                               "use another name or --fresh")
        if old == desc:
            return
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(desc, sort_keys=True))


TOKENIZER_PROBE = "The quick brown fox: 12345, naïve café. "


def check_tokenizers(entries: list[ScoredArm], tokenizer, probe: str) -> None:
    """Every endpoint with a /tokenize must turn the probe text into our ids: arms fed the
    same ids but tokenizing differently would be compared on different text."""
    want = tokenizer.encode(probe)
    for e in entries:
        tok = getattr(e.scorer, "tokenize", None)
        got = tok(probe) if tok else None
        if got is not None and got != want:
            j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise RuntimeError(f"arm {e.name}'s tokenizer differs from ours ({tokenizer.name}): the "
                               f"probe text tokenizes to {len(got)} ids vs {len(want)}, first "
                               f"difference at id {j}; pass --tokenizer with the served model's")


def score_entry(e: ScoredArm, prompts, s: KldSettings, store: ScoreStore, baseline: str,
                progress: Progress) -> int:
    """Check the stored scores are this arm's, then score what it has not scored yet."""
    check_identity(store, e)
    return score_arm(e, prompts, s, store, baseline, progress)


def run_kld(entries: list[ScoredArm], prompts, s: KldSettings, out_dir, run_id: str,
            manifest: dict, progress: Progress, twins=()) -> dict:
    """Score (resuming), compare, judge, report. Entries: the baseline first. `twins`:
    (fidelity.kld.twin.Twin, its judgement's entries) per twin, scored too and judged a
    second time (the twin the baseline). Retries (per arm and route) and capture coverage
    go to the console, manifest and summary."""
    store = ScoreStore(Path(out_dir) / "kld" / "scores")
    base = next(e for e in entries if e.role == "baseline")
    retries, counted, seen = {}, set(), set()
    for e in [base] + [e for e in entries if e is not base] + [e for _, es in twins for e in es]:
        if e.name in seen:
            continue
        seen.add(e.name)
        sc = e.scorer
        first = id(sc) not in counted          # start-up retries (connect, tokenize) go to the first
        before = {} if first else dict(getattr(sc, "retries", {}))
        counted.add(id(sc))
        n = score_entry(e, prompts, s, store, base.name, progress)
        after = getattr(sc, "retries", {})
        retries[e.name] = Counter({r: c - before.get(r, 0) for r, c in after.items()
                                     if c - before.get(r, 0)})
        note = f"; {sum(retries[e.name].values())} retries" if retries[e.name] else ""
        progress.log(f"{e.name}: {n} prompts scored, {len(prompts) - n} reused{note}")
    shape = capture_shape_of(entries, prompts, s, store) if s.captures else None
    manifest["retries"] = H.retry_summary(retries)
    res = evaluate(entries, prompts, s, store, shape, Path(out_dir) / "kld", run_id, manifest, twins=twins)
    return {**res, "retries": manifest["retries"]}


def evaluate(entries: list[ScoredArm], prompts, s: KldSettings, store: ScoreStore, shape: dict | None,
             out_dir, run_id: str, manifest: dict, coverage: bool = True, twins=(),
             latest: bool = True) -> dict:
    """From stored scores to the report: compare every arm with the baseline, the verdict's
    signals, judge, write <out_dir>/<run_id>. `coverage`: record the capture coverage in
    the manifest. `twins`: each judged again against its engines in <run_id>-vs-<twin>
    (written first), and the verdict leads with what the twins leave unexplained."""
    from . import twin as T
    tables = compare_all(entries, prompts, s, store, shape)
    tables["signals"] = http_signals(tables, [e.name for e in entries if e.role == "floor"])
    judged = judge_arms(entries, tables["signals"], s, prompts)
    if coverage:
        manifest["capture_coverage"] = tables["coverage"].to_dict("records")
    if twins:
        results = []
        for tw, es in twins:
            m = {**manifest, "baseline": tw.name, "twin": {"of": tw.engines, "arm": tw.spelling,
                                                          "source": tw.source, "report_of": run_id},
                 "arms": [arm_record(e) for e in es]}
            r = evaluate(es, prompts, s, store, shape, out_dir, f"{run_id}-vs-{tw.name}", m, coverage, latest=False)
            results.append({"twin": tw, "judged": r, "path": r["path"]})
        judged["verdict"] = T.combine(judged, results, entries[0].name)
        manifest["twins"] = [{k: v for k, v in t.items() if k not in ("named", "mechanism")}
                             for t in judged["verdict"]["twins"]]
    path = report.write(out_dir, run_id, tables, judged, manifest,
                        [e.name for e in entries if e.role != "baseline"], latest=latest)
    return {"path": path, **tables, **judged}


def capture_shape_of(entries: list[ScoredArm], prompts, s: KldSettings, store: ScoreStore) -> dict | None:
    """The capture shape from any arm that knows it; else (a resumed run whose start-up
    /get_model_info answer was unusable) asked again of an endpoint whose stored scores
    hold captures."""
    for e in entries:
        if getattr(e.scorer, "shape", None):
            return e.scorer.shape
    for e in entries:
        fetch = getattr(e.scorer, "fetch_shape", None)
        if fetch and any(getattr(store.get(e.name, p.id, score_key(s, e, p.tokens.tolist())), "indexer", None)
                         is not None for p in prompts):
            try:
                return fetch()
            except RuntimeError:                   # EndpointError: reported as coverage 0
                return None
    return None
