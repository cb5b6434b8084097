"""The in-process engine of `fidelity engines` (kind "inprocess"): arms computed in this
process -- typically the golden baseline -- on devices the launched engines also use. Both
cannot hold those devices at once, so the run is sequenced: everything that needs the golden
is computed first and stored (the in-process arms' KLD scores, `fidelity ab`'s floor arms
when the baseline is in-process, and the consistency `chunk` family's one-piece reference
of each probe prompt), then the golden's memory is released (weights, models and weight
caches dropped, CUDA's cache emptied; the bytes freed go to the run log and state.json),
and only then are the engines launched, one at a time. A rerun computes only what is not
stored, and does not load the golden at all when nothing is missing."""
from __future__ import annotations

from dataclasses import dataclass, field

from fidelity.scores.dialects import Request
from fidelity.scores.inprocess import InProcessScorer, capture_shape
from fidelity.kld.run import ScoredArm, check_identity, score_entry
from fidelity.kld.run import score_key          # the key score_arm stores under
from fidelity.scores.store import ScoreStore, request_key
from fidelity.weights.target import load_target
from kernel_toggles.arms import version_of
from reference_model.schedule import ONESHOT

from . import memory
from .context import EngineRun
from .spec import EngineSpec, Spec, SpecError
from .twins import engine_twins

REF_PROMPT = "ref"                 # the score store's prompt name for reference answers


def engine_of(spec: Spec) -> EngineSpec | None:
    """The spec's in-process engine (at most one), or None."""
    return next((e for e in spec.engines.values() if e.kind == "inprocess"), None)


def launched(spec: Spec) -> list:
    """The arms that are launched (or reached, for external engines): all but in-process ones."""
    return [a for a in spec.arms if spec.engines[a.engine].kind != "inprocess"]


def check(spec: Spec, cs) -> None:
    """Settings that cannot go with an in-process engine, refused by name before anything
    runs (`plan` too). `cs`: the run's ConsistencySettings, or None."""
    e = engine_of(spec)
    if e is None:
        return
    here = [a for a in spec.arms if a.engine == e.name]
    base = spec.arms[0]
    if here and "kld" in spec.tasks and spec.kld.get("exact") and base not in here:
        raise SpecError(f"arm {here[0].name} is computed in-process (engine {e.name}), before the launched "
                        f"baseline {base.name}, but run.kld exact = true scores each arm on the baseline's own "
                        "top ids, not known yet then: make the baseline an in-process arm or drop exact")
    if cs is None or spec.consistency.get("reference") is None:
        return
    if "longgen" in cs.families:
        raise SpecError(f"run.consistency: the longgen family scores each engine's own output with the "
                        f"reference while that engine runs, but with an in-process engine ({e.name}) the "
                        "reference is computed and released before any engine is launched (they share the "
                        "devices); drop longgen from families, or run `fidelity consistency --arm` "
                        "where the golden has devices of its own")
    if "chunk" in cs.families:
        chunk_sizes(spec, cs)


def chunk_sizes(spec: Spec, cs) -> dict[str, int]:
    """Per launched arm, the prefill chunk its chunk probes are cut at, known before launch:
    the arm's serving chunked_prefill_size, else [run.consistency.chunk] chunk_size."""
    e, plan, out = engine_of(spec), cs.chunk, {}
    for a in launched(spec):
        c = a.serving.get("chunked_prefill_size") or plan.chunk_size
        if not c:
            raise SpecError(f"arm {a.name}: the chunk family's reference is computed before any engine is "
                            f"launched (engine {e.name} is in-process), so the arm's prefill chunk size must be "
                            "known beforehand: give the arm serving = { chunked_prefill_size = N } or "
                            "[run.consistency.chunk] chunk_size = N (the engine's own)")
        n, w = plan.length or c + c // 2 + 1, min(plan.window, c // 2)
        if n <= c + w:
            raise SpecError(f"arm {a.name}: a {n}-token chunk probe does not cross the {c}-token chunk by {w} "
                            f"positions; set [run.consistency.chunk] length > {c + w}")
        out[a.name] = int(c)
    return out


def chunk_prompts(tok, plan, c: int) -> list[list[int]]:
    """The prompts ChunkFamily.run sends at chunk size c (fidelity/consistency/chunk.py builds
    them), built here so their reference is scored before the engine runs. Should that
    family's prompts ever change, StoredReference misses them and says so: never a wrong
    comparison."""
    from fidelity.consistency.chunk import chunk_prompts as built
    return built(tok, plan, c)


def _ref_key(ids: list[int], req: Request) -> str:
    return request_key(req.k, req.steps, False, req.captures, ids)


class StoredReference:
    """The consistency reference as the in-process phase stored it (chunk: score(ids, req));
    a prompt it did not store is an error naming why, never a silent recompute."""

    kind = "inprocess"

    def __init__(self, store: ScoreStore, name: str, identity: dict, sizes: list[int]):
        self.store, self.name, self.identity, self.sizes = store, name, identity, sizes

    def describe(self) -> dict:
        return {**self.identity, "stored_before_launch": True}

    def score(self, ids: list[int], req: Request):
        got = self.store.get(self.name, REF_PROMPT, _ref_key(ids, req))
        if got is None:
            raise RuntimeError(f"the consistency reference of a {len(ids)}-token prompt was not computed before "
                               f"the engines were launched (it was for prefill chunks of "
                               f"{', '.join(map(str, self.sizes)) or 'no'} tokens): if the engine reports "
                               "another chunked_prefill_size, give that as the arm's serving "
                               "chunked_prefill_size or [run.consistency.chunk] chunk_size")
        return got

    @property
    def model(self):
        raise RuntimeError("the in-process reference was released before the engines were launched; "
                           "the longgen family cannot run with an in-process engine")


class _Identity:
    """An in-process arm as the score store knows it (arm, checkpoint, accumulation dtype):
    its identity before the golden is loaded, and its InProcessScorer while it scores."""

    kind = "inprocess"

    def __init__(self, identity: dict):
        self.identity, self.scorer = identity, None

    def describe(self) -> dict:
        return self.identity

    def score(self, ids, req):
        return self.scorer.score(ids, req)


@dataclass
class Job:
    """One in-process arm to score: its entry (role, factors), numerics and schedule."""
    entry: ScoredArm
    numerics: object
    schedule: object = ONESHOT
    label: str = ""


def _identity(name: str, label: str, e: EngineSpec, cd) -> dict:
    return {"name": name, "kind": "inprocess", "arm": label, "checkpoint": e.model or "embedded",
            "accumulate": str(cd).replace("torch.", "")}


def kld_jobs(spec: Spec, e: EngineSpec, cd, version: str = "v4") -> list[Job]:
    """The in-process arms' KLD scoring, the baseline first; with an in-process baseline,
    `fidelity ab`'s floor arms (as `fidelity kld --arm` adds them) after it, then each
    launched arm's twin and the floors around it (fidelity.engines.twins)."""
    from fidelity.ab.design import floor_arms
    from fidelity.design.arms import parse_arm
    from fidelity.kld.floors import floor_numerics

    def job(name, role, numerics, label, factors=frozenset(), schedule=ONESHOT):
        return Job(ScoredArm(name, _Identity(_identity(name, label, e, cd)), role, factors), numerics, schedule, label)
    jobs = []
    for a in spec.arms:
        if a.engine != e.name:
            continue
        na = parse_arm(str(a.toggles) if a.toggles is not None else "golden")
        jobs.append(job(a.name, a.role, na.numerics(compute_dtype=cd), na.name, a.factors, na.schedule))
        if a.role == "baseline":
            jobs += [job(f.name, "floor", f.numerics, f.name) for f in floor_arms(cd)]
    for tw in engine_twins(spec, version):
        na = parse_arm(tw.spelling, version)
        jobs.append(job(tw.name, "twin", na.numerics(compute_dtype=cd), na.name, schedule=na.schedule))
        jobs += [job(f"{tw.name}~{f}", "floor", nx, f"{na.name} ({f})", schedule=na.schedule)
                 for f, nx in floor_numerics(tw.spelling, version, cd, qat=False)]
    return jobs


def baseline_inprocess(spec: Spec) -> bool:
    return spec.engines[spec.arms[0].engine].kind == "inprocess"


def placement(e: EngineSpec):
    """Where the in-process engine computes and in which dtype it accumulates."""
    from fidelity.weights.devices import DeviceError, Placement, accumulate_dtype, parse_devices
    try:
        devices = parse_devices(list(e.devices))
        return Placement(devices, accumulate_dtype(devices, e.accumulate))
    except DeviceError as ex:
        raise SpecError(f"engines.{e.name}.devices: {str(ex).removeprefix('--devices: ')}; nothing was "
                        "launched") from None


def twin_judgements(spec: Spec, version: str) -> list:
    """(Twin, the names and roles of its judgement's arms) per launched arm's twin, for the
    report (scores read from the store)."""
    from fidelity.kld.run import twin_entries
    e = engine_of(spec)
    if e is None or "kld" not in spec.tasks:
        return []
    floors = {j.entry.name: j for j in kld_jobs(spec, e, placement(e).compute_dtype, version)
              if j.entry.role == "floor"}
    arms = {a.name: ScoredArm(a.name, None, a.role, a.factors) for a in spec.arms}
    return [(tw, twin_entries(tw, None, [(n, None) for n in floors if n.startswith(f"{tw.name}~")], arms))
            for tw in engine_twins(spec, version)]


def run_inprocess(run: EngineRun, cs, done_arms) -> StoredReference | None:
    """Score and store everything that needs the golden, then release it (module docstring).
    `cs`: the consistency settings (or None); `done_arms`: launched arms whose tasks
    finished (no reference is computed for them). Returns the consistency reference the
    launched arms read, or None."""
    spec, state, prompts, s, store, progress = run.spec, run.state, run.prompts, run.settings, run.store, run.progress
    e = engine_of(spec)
    place = placement(e)
    cd, tag = place.compute_dtype, f"in-process engine {e.name}"
    jobs = kld_jobs(spec, e, cd, version_of(run.target.cfg)) if "kld" in spec.tasks else []
    for j in jobs:
        check_identity(store, j.entry)          # another checkpoint under an old name: before loading
    todo = {j.entry.name: sum(not store.path(j.entry.name, p.id, score_key(s, j.entry, p.tokens.tolist())).exists()
                              for p in prompts) for j in jobs}       # in-process scores are never partial
    ref = _reference(run, e, place, cs, done_arms)
    for a in spec.arms:
        if a.engine == e.name:
            st = state.arm(a.name)
            st["engine"] = {"inprocess": {"engine": e.name, "checkpoint": e.model or "embedded",
                                          **place.describe()}}
            st["shape"] = capture_shape(run.target.cfg)
    if any(a.engine == e.name for a in spec.arms) and {"needle", "consistency"} & set(spec.tasks):
        progress.log(f"{tag}: its arms take part in kld (and give the consistency reference); needle and "
                     "consistency probe the launched arms only")
    if not jobs and ref.stored is None:
        progress.log(f"{tag}: nothing to compute for tasks {', '.join(spec.tasks)}; the golden is not loaded")
        state.event("golden not loaded", engine=e.name, reason="nothing to compute")
    elif not sum(todo.values()) and not ref.todo:
        progress.log(f"{tag}: everything it computes is stored ({len(jobs)} arms x {len(prompts)} prompts"
                     + (", the consistency reference" if ref.stored else "") + "); the golden is not loaded")
        state.event("golden not loaded", engine=e.name, reason="everything stored")
    else:
        _compute(run, e, place, jobs, todo, ref)
    for a in spec.arms:
        if a.engine == e.name and "kld" in spec.tasks and "kld" not in state.arm(a.name)["done"]:
            state.arm(a.name)["done"].append("kld")
    state.save()
    return ref.stored


def _compute(run: EngineRun, e: EngineSpec, place, jobs: list, todo: dict, ref: "ReferenceWork") -> None:
    """Load the golden, score what is missing (`todo`: prompts per job's arm; `ref`: the
    consistency reference), log what was scored, release it (also when scoring fails: the
    error is the run's, the devices are the engines')."""
    spec, state, prompts, progress = run.spec, run.state, run.prompts, run.progress
    tag = f"in-process engine {e.name}"
    where = (f"{e.model or 'the embedded model'} on {','.join(place.devices)}, "
             f"accumulate {str(place.compute_dtype).replace('torch.', '')}")
    progress.log(f"{tag}: loading the golden ({where}) before any engine is launched")
    state.event("golden loaded", engine=e.name, checkpoint=e.model or "embedded", **place.describe())
    holder = {"weights": load_target(e.model, spec.kld.get("tokenizer"), e.weights_mode,
                                     place.model_devices).weights,
              "weight_cache": {}}                  # converted weights, shared by the arms of one dtype
    scored = {}
    try:
        base = spec.arms[0].name
        for j in jobs:
            if not todo[j.entry.name]:
                scored[j.entry.name] = {"prompts": 0, "stored_earlier": len(prompts)}
                continue
            j.entry.scorer.scorer = holder[f"arm {j.entry.name}"] = InProcessScorer(
                j.entry.name, j.numerics, holder["weights"], j.label, place.model_devices, j.schedule,
                holder["weight_cache"])
            n = score_entry(j.entry, prompts, run.settings, run.store, base, progress)
            scored[j.entry.name] = {"prompts": n, "stored_earlier": len(prompts) - n}
        if ref.todo:
            stored, arm = ref.stored, ref.arm
            holder["reference"] = InProcessScorer(stored.name, arm.numerics(compute_dtype=place.compute_dtype),
                                                  holder["weights"], arm.name, place.model_devices,
                                                  arm.schedule, holder["weight_cache"])
            for ids, req in ref.todo:
                stored.store.put(stored.name, REF_PROMPT, _ref_key(ids, req), holder["reference"].score(ids, req))
            scored[f"consistency reference {stored.name}"] = {"prompts": len(ref.todo), "family": "chunk"}
        progress.log(f"{tag}: golden scored: " + "; ".join(
            f"{k}: {v['prompts']} prompts" + (f" ({v['stored_earlier']} stored earlier)" if "stored_earlier" in v else
                                              f" ({v['family']} family)") for k, v in scored.items()))
        state.event("golden scored", engine=e.name, scored=scored)
    finally:
        for j in jobs:                             # only the holder may keep the golden alive
            j.entry.scorer.scorer = None
        r = memory.release(holder, place.devices)
        progress.log(f"{tag}: memory released before any engine is launched: {memory.describe(r)}")
        state.event("memory released", engine=e.name, **r)


@dataclass
class ReferenceWork:
    """The consistency reference of an in-process engine: where it is stored (None: the
    run has none), the arm it is computed with, and the (ids, request) still to compute."""
    stored: StoredReference | None = None
    arm: object = None
    todo: list = field(default_factory=list)


def _reference(run: EngineRun, e: EngineSpec, place, cs, done_arms) -> ReferenceWork:
    """What the run's consistency reference needs computed (module docstring)."""
    spec, root, tok = run.spec, run.root, run.target.tokenizer
    text = spec.consistency.get("reference")
    if cs is None or text is None:
        return ReferenceWork()
    from fidelity.design.arms import parse_arm
    arm = parse_arm(text)
    ident = _identity(arm.name, arm.name, e, place.compute_dtype)
    rstore = ScoreStore(root / "consistency" / "reference")
    check_identity(rstore, ScoredArm(arm.name, _Identity(ident)))
    sizes = chunk_sizes(spec, cs) if "chunk" in cs.families else {}
    ref = StoredReference(rstore, arm.name, ident, sorted(set(sizes.values())))
    req, want = Request(k=cs.chunk.k, steps=1), {}
    for name, c in sizes.items():
        if name not in done_arms:
            for ids in chunk_prompts(tok, cs.chunk, c):
                want[_ref_key(ids, req)] = ids
    todo = [(ids, req) for k, ids in want.items() if not rstore.path(arm.name, REF_PROMPT, k).exists()]
    return ReferenceWork(ref, arm, todo)
