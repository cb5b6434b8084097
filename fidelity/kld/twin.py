"""`fidelity kld`'s second judgement: each served engine against its twin, the in-process
arm its settings map to (fidelity.kld.floors). Against the golden an engine differs by design
(llama.cpp skips the QAT simulation and keeps f16 caches), and that known gap hides any
smaller bug; against its twin only what no modelled arithmetic explains remains.

The twin of an endpoint, unless `--twin NAME=...` says otherwise: llama-server -> the
exact profile with the toggles its default flags map to (fidelity.llamacpp.flags; /props
does not state the cache type, so a server launched with -ctk q8_0 needs `--twin
NAME="-ctk q8_0"`); SGLang / vLLM -> that engine's `engine:` arm (its profiled defaults);
`fidelity serve` -> the arm it states it serves. Floors of the engine-vs-twin comparison
are noise on both sides: the twin's own reduction- and tie-order variants and the
engine's own run-to-run noise (the endpoint scored twice, compared with itself) -- never
the golden's QAT floor, which neither side has."""
from __future__ import annotations

from dataclasses import dataclass, field

from fidelity import servers
from fidelity.llamacpp.flags import scored_twin as llama_twin
from fidelity.verdict.judge import floor_words
from fidelity.verdict.tail import METHOD as TAIL


NONE = "none"


@dataclass
class Twin:
    """One twin: its arm spelling, where that came from, the endpoint arms it models and
    its name among the run's arms."""
    spelling: str
    source: str
    engines: list[str] = field(default_factory=list)
    name: str = "twin"


def derived(ep) -> tuple[str, str] | None:
    """(spelling, source) of an Endpoint's twin from what it says of itself; None when it
    says nothing a twin can be derived from (a plain OpenAI server)."""
    return servers.served_as(ep).twin_of_endpoint(ep)


def parse_options(values: list[str], endpoints: list[str]) -> dict[str, str]:
    """--twin NAME=ARM | NAME=llama-server flags (starting with '-') | NAME=none -> {name:
    spelling or NONE}; a name that is no endpoint is a ValueError."""
    import shlex
    out = {}
    for v in values:
        name, eq, spec = v.partition("=")
        name, spec = name.strip(), spec.strip()
        if not eq or not name or not spec:
            raise ValueError(f"--twin {v!r}: expected NAME=ARM, NAME=\"-ctk q8_0\" (llama-server flags) or NAME=none")
        if name not in endpoints:
            raise ValueError(f"--twin {name}: no --endpoint is named {name!r} ({', '.join(endpoints) or 'none given'})")
        out[name] = spec if spec == NONE or not spec.startswith("-") else llama_twin(shlex.split(spec))
    return out


def twins_of(endpoints: list, given: dict[str, str], canonical=lambda s: s) -> tuple[list[Twin], list[str]]:
    """The twins of the endpoint arms (one per distinct arm, `canonical(spelling)` saying
    which spellings are one arm; named `twin` when there is one, else `twin-<first
    engine>`), and a note per endpoint left without one."""
    by_spelling: dict[str, Twin] = {}
    notes = []
    for ep in endpoints:
        if given.get(ep.name) == NONE:
            continue
        got = (given[ep.name], "--twin") if ep.name in given else derived(ep)
        if got is None:
            notes.append(f"{ep.name}: no twin (a plain OpenAI server states nothing to derive one from; "
                         f"give --twin {ep.name}=ARM)")
            continue
        try:
            spelling = canonical(got[0])
        except ValueError as e:
            if ep.name in given:
                raise ValueError(f"--twin {ep.name}={got[0]}: {e}") from None
            notes.append(f"{ep.name}: no twin ({got[1]} gives {got[0]!r}, which does not parse here: {e}; "
                         f"give --twin {ep.name}=ARM)")
            continue
        t = by_spelling.setdefault(spelling, Twin(spelling, got[1]))
        t.engines.append(ep.name)
    twins = list(by_spelling.values())
    if len(twins) > 1:
        for t in twins:
            t.name = f"twin-{t.engines[0]}"
    return twins, notes


def sentence(twin: Twin, judged: dict) -> str:
    """The twin judgement in words: what is unexplained, or that the engines match it."""
    v = judged["verdict"]
    if v.get("named"):
        return f"Unexplained (vs its twin `{twin.spelling}`): {v['outcome_sentence']}"
    t = judged["attribution"]
    # the mean's effect, not a tail row (one prompt's value, quoted as "largest mean KLD"
    # with a zero-width interval, 42x a floor the mean stays under)
    k = t[(t.signal == "kld_mean") & (t.method != TAIL)] if len(t) else t
    worst = k.sort_values("value", ascending=False).iloc[0] if len(k) else None
    detail = (f" (largest mean KLD: {worst.toggle}, {worst.value:.3g} [{worst.lo:.3g}, {worst.hi:.3g}] "
              f"{floor_words(worst.floor_hi, worst.get('floor_arm'), 'vs the highest floor')})"
              if worst is not None else "")
    mech = f" {v['mechanism_sentence']}" if v.get("mechanism") else ""
    return f"{matches(twin)}{detail}.{mech}"


def matches(twin: Twin) -> str:
    return (f"{', '.join(twin.engines)} match{'es' if len(twin.engines) == 1 else ''} "
            f"the twin `{twin.spelling}` within its floors")


def _kld(summary, arm: str) -> str:
    """An arm's mean KLD against the golden judgement's baseline, in words."""
    r = summary[(summary.arm == arm) & (summary.signal == "kld_mean") & (summary["where"] == "final logits")]
    return f"{r.iloc[0]['mean']:.3g}" if len(r) else "n/a"


def by_design(twin: Twin, golden_judged: dict, baseline: str) -> str:
    """How far the twin and its engines sit from the golden: the gap the twin's toggles explain."""
    s = golden_judged["summary"]
    engines = ", ".join(f"{e} {_kld(s, e)}" for e in twin.engines)
    return (f"By design: the twin `{twin.spelling}` ({twin.source}) is {_kld(s, twin.name)} from "
            f"{baseline} (mean KLD), {engines}.")


def combine(golden_judged: dict, results: list[dict], baseline: str) -> dict:
    """The golden verdict with the twin judgements in front: each twin's unexplained finding
    (or its match), then the by-design gap, then the golden verdict itself. `results`: one
    {twin, judged, path} per twin."""
    v = dict(golden_judged["verdict"])
    twins = []
    for r in results:
        t, j = r["twin"], r["judged"]
        twins.append({"name": t.name, "twin": t.spelling, "source": t.source, "engines": t.engines,
                      "unexplained": bool(j["verdict"].get("named")), "sentence": sentence(t, j),
                      "matches": (f"{', '.join(t.engines)} match{'es' if len(t.engines) == 1 else ''} "
                                  f"its twin `{t.name}` within the twin's floors"),     # short: headlines
                      "by_design": by_design(t, golden_judged, baseline), "named": j["verdict"].get("named", []),
                      "mechanism": j["verdict"].get("mechanism", []), "report": r["path"].name})
    v["twins"] = twins
    v["golden_sentence"] = v["sentence"]
    lead = sorted(twins, key=lambda x: not x["unexplained"])
    v["sentence"] = " ".join([x["sentence"] for x in lead] + [x["by_design"] for x in lead]
                             + [f"Against {baseline}: {v['golden_sentence']}"])
    return v


def headline(v: dict, golden_headline: str) -> str:
    """One sentence first: the unexplained finding when there is one, else a change inside
    against the twin (indexer picks, the needle's entry, experts: what loses a needle at
    longer lengths while the outcome here stays within floors), else the match to the twin;
    then what the golden judgement says."""
    tw = v.get("twins") or []
    bad = [x for x in tw if x["unexplained"]]
    if bad:
        from fidelity.verdict.board import headline as board_headline
        x = bad[0]
        return (f"Unexplained (vs twin `{x['name']}`, spelled out in the twin table): "
                + board_headline({"named": x["named"]}) + f" Against the golden: {golden_headline}")
    inside = [x for x in tw if x["mechanism"]]
    if inside:                     # the seeds' class: picks move while the outcome stays within floors
        from fidelity.verdict.board import mechanism_headline
        x = inside[0]
        return (f"Inside, against its twin `{x['name']}`: " + mechanism_headline(x["mechanism"])
                + f" Against the golden: {golden_headline}")
    if tw:
        return f"{matched(v)} Against the golden: {golden_headline}"
    return golden_headline


def matched(v: dict) -> str:
    """The twins' matches, a short sentence each (the twin by its name; its spelling is in
    the twin table): what a headline says when no twin judgement finds anything."""
    return " ".join(x["matches"] + "." for x in v.get("twins") or [])


def flagged(v: dict) -> bool:
    """What the kld command's exit code reads (fidelity.errors): with twins, an engine
    unexplained by its twin or changing inside against it (a by-design gap to the golden is
    not a finding); without, a toggle the verdict names."""
    tw = v.get("twins")
    if tw:
        return any(x["unexplained"] or x["mechanism"] for x in tw)
    return bool(v.get("named"))


def verdict_headline(v: dict) -> str:
    """The page's one sentence for a verdict that may hold twin judgements (kld, engines)."""
    from fidelity.verdict.board import headline as board_headline
    return headline(v, board_headline(v))
