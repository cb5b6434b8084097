"""`fidelity kld`: logit-level A/B of running servers (and in-process arms) over HTTP.
The defaults are fidelity.kld.settings' (shared with the engines spec). Heavy modules
(torch, the model, the report) are imported inside the functions: `fidelity --help`
stays quick."""
from __future__ import annotations

import sys
import time

from infra.command import command_line
from fidelity.weights.devices import arithmetic
from fidelity.commands.options import api_key, endpoint_pair, http_options, output_options, retired
from fidelity.errors import CommandError, exit_code
from fidelity.design.lengths import HELP as LENGTHS_HELP
from fidelity.design.lengths import argtype as lengths_arg
from fidelity.kld.settings import HttpSettings, KldSettings, PromptGrid

HELP = ("KLD of live endpoints (and in-process arms) against a baseline over HTTP: "
        "llama.cpp-style statistics, decode ladder, captures, attribution and verdict.")
EXAMPLES = """\
    fidelity kld --arm golden=golden --endpoint engine=http://127.0.0.1:30000   # a live engine vs the golden
    fidelity kld --endpoint base=http://127.0.0.1:30000 --endpoint new=http://127.0.0.1:30001 --exact
    fidelity kld --distributed --checkpoint /models/DeepSeek-V4-Pro --arm golden=golden --endpoint engine=http://127.0.0.1:30000   # each rank of `torchrun --nproc-per-node 8 -m fidelity kld --distributed ...` (docs/distributed.md)
"""


def _csv(text, typ):
    return [typ(x) for x in text.split(",") if x.strip()]


def add_arguments(p):
    g = p.add_argument_group("arms")
    g.add_argument("--endpoint", action="append", default=[], metavar="NAME=URL", type=endpoint_pair,
                   help="a running server (root or /v1 URL; repeatable)")
    retired(g, "--inprocess", "--arm", "inprocess", append=True, metavar="NAME=ARM")
    g.add_argument("--arm", dest="inprocess", action="append", default=[], metavar="NAME=ARM",
                   help="an arm computed here on the embedded model or --checkpoint, with the "
                        "whole vocabulary known (exact KL), e.g. golden=golden (repeatable)")
    g.add_argument("--baseline", default=None,
                   help="the arm the others are compared with (default: the first --arm, "
                        "else the first --endpoint)")
    g.add_argument("--dialect", action="append", default=[], metavar="NAME=DIALECT",
                   help="force an endpoint's dialect: sglang, vllm, llamacpp or openai (default: detected)")
    g.add_argument("--floor", action="append", default=[], metavar="NAME",
                   help="an endpoint arm that is a noise floor, not a candidate (repeatable)")
    g.add_argument("--twin", action="append", default=[], metavar="NAME=ARM",
                   help="the in-process twin of endpoint NAME (the arm its settings map to), judged "
                        "against it a second time: an arm spelling (exact:expert_act_q8_0,kv_cache_ggml), "
                        "llama-server flags (NAME=\"-ctk q8_0\") or none (default: derived from what the "
                        "server says of itself: llama-server's default flags, SGLang's/vLLM's engine "
                        "profile, the arm fidelity serve serves; repeatable)")
    g.add_argument("--no-twin", action="store_true",
                   help="judge endpoints against the baseline only, not also against their twins")
    g.add_argument("--no-floors", action="store_true",
                   help="skip the automatic floors (in-process floor arms, or the baseline "
                        "endpoint scored twice)")
    g.add_argument("--model", action="append", default=[], metavar="[ARM=]MODEL",
                   help="served model an endpoint arm scores (repeatable): ARM=MODEL for one "
                        "arm, a bare MODEL for the others (default: the model named like the "
                        "arm, else the only one served; a server serving several models and "
                        "none named like the arm is an error)")
    g.add_argument("--checkpoint", default=None, help="weights of in-process arms")
    g.add_argument("--tokenizer", default=None, help="tokenizer.json the prompts are built with")
    from fidelity.weights.devices import add_options
    add_options(p)
    from fidelity.commands.options import distributed_options
    distributed_options(p.add_argument_group("distributed (docs/distributed.md)"), "kld")
    g = p.add_argument_group("prompts")
    g.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help="your own prompts: one JSON per line with text, messages or token_ids")
    g.add_argument("--lengths", default=",".join(map(str, PromptGrid.lengths)), type=lengths_arg,
                   metavar="L,L|boundaries[:MAX]",
                   help="comma-separated prompt lengths in tokens for the built-in needle "
                        "prompts (default: %(default)s), " + LENGTHS_HELP)
    g.add_argument("--depths", default=",".join(f"{d:g}" for d in PromptGrid.depths),
                   help="comma-separated needle depths in percent (default: %(default)s)")
    g.add_argument("--reps", type=int, default=PromptGrid.reps,
                   help="prompts per (length, depth), different needles (default: %(default)s)")
    g.add_argument("--seed", type=int, default=PromptGrid.seed,
                   help="seed of the prompts and of the bootstrap (default: %(default)s)")
    g = p.add_argument_group("scoring")
    g.add_argument("--top-k", type=int, default=KldSettings.k,
                   help="top-k logprobs per position (default %(default)s)")
    g.add_argument("--decode-steps", dest="steps", type=int, default=KldSettings.steps,
                   help="greedy decode ladder length (default %(default)s)")
    retired(g, "--steps", "--decode-steps", "steps", type=int)
    g.add_argument("--exact", action="store_true",
                   help="arms also score the baseline's own top ids (SGLang token_ids_logprob; "
                        "vLLM prompt_logprobs -1): the KL bound becomes exact up to the "
                        "reported uncovered mass")
    g.add_argument("--exact-k", type=int, default=KldSettings.exact_k,
                   help="with --exact on SGLang: how many of the baseline's top ids per position "
                        "each arm scores (default: %(default)s)")
    g.add_argument("--no-captures", action="store_true",
                   help="do not ask for indexer top-k / routed-expert captures (default: ask "
                        "where an arm offers them; coverage is reported)")
    g.add_argument("--n-boot", type=int, default=KldSettings.n_boot,
                   help="bootstrap resamples for confidence intervals (default: %(default)s)")
    http_options(g, timeout=HttpSettings.timeout)
    output_options(p, "kld", "kld-<timestamp>", fresh="discard stored scores instead of resuming",
                   out_help="writes <out>/kld/scores (resumable) and <out>/kld/<run-id>/ (default: %(default)s)")


def floor_numerics(k: int, compute_dtype):
    """The k-th automatic floor arm's Numerics (a recipe every pipeline rank can rebuild)."""
    from fidelity.ab.design import floor_arms
    return floor_arms(compute_dtype)[k].numerics


def build_entries(args, target, progress, place=None, driver=None):
    """ScoredArm list, the baseline first. `driver` (fidelity.pipeline.model.Driver, on
    rank 0 under --distributed): in-process arms run across the pipeline."""
    from infra.http import RetryPolicy, model_options
    from fidelity.design.arms import parse_arm
    from fidelity.kld.endpoint import Endpoint
    from fidelity.scores.inprocess import InProcessScorer
    from fidelity.kld.run import ScoredArm

    from fidelity.cli import name_value_pairs as _pairs
    dialects = dict(_pairs(args.dialect, "--dialect"))
    endpoints = _pairs(args.endpoint, "--endpoint")
    every, per_arm = model_options(args.model, [n for n, _ in endpoints])
    policy = RetryPolicy(retries=args.retries, timeout=args.timeout)
    entries = []
    from kernel_toggles.arms import version_of
    version = version_of(target.cfg)
    for name, spec in _pairs(args.inprocess, "--arm"):
        arm = parse_arm(spec, version)
        kw = {"compute_dtype": place.compute_dtype} if place else {}
        from fidelity.pipeline.model import arm_numerics
        model = driver.model((arm_numerics, spec, "reference", kw, version), arm.schedule) if driver else None
        nx = None if driver else arm_numerics(spec, "reference", kw, version)
        entries.append(ScoredArm(name, InProcessScorer(name, nx, target.weights, arm.name,
                                                       place.model_devices if place else None,
                                                       arm.schedule, model=model),
                                 factors=frozenset({name})))
    for name, url in endpoints:
        ep = Endpoint(name, url, dialects.pop(name, None), per_arm.get(name, every), policy,
                      target.tokenizer, on_retry=progress.log, api_key=api_key(args)).connect()
        ep.check_vocab(target.cfg.vocab_size)
        progress(f"{name}: {ep.describe()['url']} model {ep.model}, dialect {ep.dialect}")
        entries.append(ScoredArm(name, ep, "floor" if name in args.floor else "arm", frozenset({name})))
    if dialects:
        raise ValueError(f"--dialect names no endpoint: {', '.join(dialects)}")
    if not entries:
        raise ValueError("give at least two arms (--endpoint and/or --arm)")
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names repeat: {names}")
    base = args.baseline or (entries[0].name if args.inprocess else
                             next(e.name for e in entries if e.scorer.kind == "endpoint"))
    if base not in names:
        raise ValueError(f"--baseline {base!r} is not an arm ({', '.join(names)})")
    b = entries.pop(names.index(base))
    b.role, b.factors = "baseline", frozenset()
    entries.insert(0, b)
    if not args.no_floors:
        entries += auto_floors(b, target, place, driver)
    if len([e for e in entries if e.role == "arm"]) < 1:
        raise ValueError("nothing to compare: give at least one arm besides the baseline")
    return entries


def build_twins(args, entries, target, progress, place=None, driver=None):
    """(Twin, its judgement's entries) per twin of the endpoint arms, the twins also added to
    `entries` as context arms (compared with the baseline, not judged): only when the
    baseline runs here (the twin needs the weights) and not --no-twin."""
    from fidelity.kld import twin as T
    from fidelity.kld.run import ScoredArm, twin_entries
    from kernel_toggles.arms import version_of
    eps = [e.scorer for e in entries if e.role == "arm" and e.scorer.kind == "endpoint"]
    given = T.parse_options(args.twin, [e.name for e in entries if e.scorer.kind == "endpoint"])
    if args.no_twin or not eps or entries[0].scorer.kind != "inprocess":
        if given and not args.no_twin:
            raise ValueError("--twin needs the baseline to run in-process (--arm golden=golden)")
        return []
    from fidelity.design.arms import parse_arm
    version = version_of(target.cfg)
    canonical = lambda spelling: parse_arm(spelling, version).name  # noqa: E731
    twins, notes = T.twins_of(eps, given, canonical)
    for n in notes:
        progress(n)
    by_name = {e.name: e for e in entries}
    base = canonical(entries[0].scorer.label)
    out = []
    for tw in twins:
        if tw.spelling == base:                   # the baseline is this twin: one judgement says it all
            progress(f"twin of {', '.join(tw.engines)}: {tw.spelling}, the baseline {entries[0].name} itself")
            continue
        while tw.name in by_name:
            tw.name += "~twin"
        try:
            (_, make), *floors = _inprocess_around(tw.spelling, target, place, driver, own=tw.name,
                                                   floors=None if args.no_floors else f"{tw.name}~", qat=False)
        except ValueError as e:
            raise ValueError(f"twin of {', '.join(tw.engines)} ({tw.spelling}): {e}") from None
        progress(f"twin of {', '.join(tw.engines)}: {tw.spelling} ({tw.source})")
        entries.append(ScoredArm(tw.name, make, "twin"))
        es = twin_entries(tw, make, floors, by_name)
        out.append((tw, es if floors else [e for e in es if e.role != "floor"]))
    return out


def _inprocess_around(spelling: str, target, place=None, driver=None, own: str | None = None,
                      floors: str | None = "", qat: bool = True) -> list:
    """[(name, scorer)] of the in-process arm `spelling` (named `own`; left out when None)
    and of the floors around it (fidelity.kld.floors.floor_numerics, with its QAT floor when
    `qat`), each named `floors` + its floor name (left out when `floors` is None)."""
    import torch
    from fidelity.scores.inprocess import InProcessScorer
    from fidelity.pipeline.model import arm_numerics
    from fidelity.design.arms import parse_arm
    from fidelity.kld.floors import floor_numerics as around
    from kernel_toggles.arms import version_of
    version = version_of(target.cfg)
    cd = place.compute_dtype if place else torch.float64
    devices = place.model_devices if place else None
    schedule = parse_arm(spelling, version).schedule      # the floors are read as the arm is
    recipes = [] if own is None else [(own, spelling, (arm_numerics, spelling, "reference", {"compute_dtype": cd},
                                                       version))]
    if floors is not None:
        recipes += [(f"{floors}{f}", f"{spelling} ({f})", (_around_numerics, spelling, version, cd, k, qat))
                    for k, (f, _) in enumerate(around(spelling, version, cd, qat))]
    return [(n, InProcessScorer(n, None if driver else fn(*a), target.weights, label, devices, schedule,
                                model=driver.model((fn, *a), schedule) if driver else None))
            for n, label, (fn, *a) in recipes]


def auto_floors(base, target, place=None, driver=None):
    """In-process baseline: the floors of a comparison against it (fidelity.kld.floors: `fidelity
    ab`'s three around the golden; around another arm, its own reduction- and tie-order
    variants, and its QAT floor only on the reference profile); endpoint baseline: itself
    again."""
    import torch
    from fidelity.scores.inprocess import InProcessScorer
    from fidelity.kld.run import ScoredArm, repeat_floor
    if base.scorer.kind != "inprocess":
        return [repeat_floor(base)]
    cd = place.compute_dtype if place else torch.float64
    devices = place.model_devices if place else None
    if base.scorer.label == "golden":
        from fidelity.ab.design import floor_arms
        return [ScoredArm(a.name, InProcessScorer(a.name, a.numerics, target.weights, None, devices,
                                                  model=driver.model((floor_numerics, k, cd)) if driver else None),
                          "floor")
                for k, a in enumerate(floor_arms(cd))]
    return [ScoredArm(n, sc, "floor") for n, sc in _inprocess_around(base.scorer.label, target, place, driver)]


def _around_numerics(spec: str, version: str, cd, k: int, qat: bool = True):
    """The k-th floor around the in-process arm `spec` (a recipe every pipeline rank can rebuild)."""
    from fidelity.kld.floors import floor_numerics as around
    return around(spec, version, cd, qat)[k][1]


def run(args) -> int:
    if args.distributed is None:
        return _run(args)
    from fidelity.pipeline.model import run_ranks
    if not args.inprocess:
        raise CommandError("--distributed runs the in-process arms across the ranks; give at least one "
                           "--arm (endpoint arms are scored from rank 0 as usual)")
    return run_ranks(args, lambda driver: _run(args, driver), lambda cfg: _need(args, cfg))


def _need(args, cfg):
    """What a distributed kld holds at once: one prompt (its decode ladder included) per
    in-process arm and automatic floor, with every position's logits."""
    from fidelity.ab.design import floor_arms
    from fidelity.pipeline.model import Need
    from fidelity.weights.target import load_target
    if args.prompts:
        from fidelity.design.prompts import file_prompts
        tok = load_target(args.checkpoint, args.tokenizer, "streamed").tokenizer      # reads no layer
        longest = max((p.length for p in file_prompts(args.prompts, tok, cfg.vocab_size)), default=1)
    else:
        tok = load_target(args.checkpoint, args.tokenizer, "streamed").tokenizer if args.lengths.boundaries else None
        longest = max(_lengths(args, cfg, tok)[0], default=1)
    baseline_inprocess = args.baseline is None or args.baseline in {n for n, _ in
                                                                   (a.split("=", 1) for a in args.inprocess)}
    floors = 0 if args.no_floors or not baseline_inprocess else len(floor_arms())
    twins = 0 if args.no_twin or not baseline_inprocess else len(args.endpoint) * (1 + len(floor_arms()))
    return Need(longest + args.steps, len(args.inprocess) + floors + twins)


def _lengths(args, cfg, tok) -> tuple[list[int], str]:
    """The built-in prompts' lengths (the boundary grid from `cfg`, above the shortest
    haystack when a tokenizer is given) and what the grid left out ('' if nothing)."""
    from fidelity.design.lengths import resolve, shortest_haystack
    from needle.haystack import LocalCounter
    lengths, _, note = resolve(args.lengths, cfg, shortest_haystack(LocalCounter(tok)) if tok else 2)
    return lengths, note


def _run(args, driver=None) -> int:
    """The command on one process, or on rank 0 with `driver`'s pipeline models."""
    from fidelity.kld.run import run_kld
    from fidelity.kld.endpoint import EndpointError
    from dataclasses import asdict

    from fidelity.design.lengths import Boundaries, LengthsError
    from fidelity.design.prompts import PromptFileError, file_prompts, grid_prompts

    from fidelity.progress import Progress
    progress = Progress(args.quiet)
    try:
        from fidelity.weights.devices import DeviceError, from_args
        place = from_args(args)
        from fidelity.pipeline.model import command_target
        target = command_target(args, place, driver)
        entries = build_entries(args, target, progress, place, driver)
        twins = build_twins(args, entries, target, progress, place, driver)
        tok = target.tokenizer
        if args.prompts:
            prompts = file_prompts(args.prompts, tok, target.cfg.vocab_size)
        else:
            lengths, note = _lengths(args, target.cfg, tok)
            if note:
                progress(note)
            prompts = grid_prompts(tok, lengths, _csv(args.depths, float), args.reps, args.seed)
        from fidelity.design.arms import check_schedules, split_schedule
        from fidelity.cli import name_value_pairs
        check_schedules({n: split_schedule(s)[1] for n, s in name_value_pairs(args.inprocess, "--arm")},
                        [p.length for p in prompts])          # before any arm is scored
        from fidelity.kld.run import TOKENIZER_PROBE, arm_record, check_tokenizers
        check_tokenizers(entries, tok, TOKENIZER_PROBE)
        from fidelity.kld.identity import check_models
        check_models(entries, prompts[0].tokens.tolist(), args.checkpoint or "the embedded checkpoint")
        if args.fresh:
            import shutil
            from pathlib import Path
            shutil.rmtree(Path(args.out) / "kld" / "scores", ignore_errors=True)
        s = KldSettings(k=args.top_k, steps=args.steps, exact=args.exact, exact_k=args.exact_k,
                        captures=not args.no_captures, n_boot=args.n_boot, seed=args.seed)
        from reference_model.version import parts_for
        manifest = {"command": command_line(), "baseline": entries[0].name,
                    "reference": parts_for(target.cfg).reference,
                    "settings": s.__dict__, "tokenizer": tok.name,
                    "arms": [arm_record(e) for e in entries],
                    "servers": {e.name: getattr(e.scorer, "info", None) for e in entries},
                    "prompts": [{"id": p.id, "length": p.length, "group": p.group} for p in prompts],
                    "lengths": None if args.prompts else str(args.lengths),
                    "boundaries": asdict(Boundaries.of(target.cfg)), "arithmetic": arithmetic()}
        res = run_kld(entries, prompts, s, args.out, args.run_id or time.strftime("kld-%Y%m%d-%H%M%S"),
                      manifest, progress, twins)
    except (ValueError, RuntimeError, EndpointError, PromptFileError, DeviceError, LengthsError) as e:
        raise CommandError(str(e)) from None
    print(res["verdict"]["sentence"])
    if not args.prompts and args.lengths.boundaries:     # the grid's point: which residue breaks
        from fidelity.kld.report import residues
        print("answer KLD by length residue (breaks: prompts at 10x or more of every floor on that prompt):")
        print(residues(res["signals"], manifest)[0].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    _health_lines(res)
    print(f"report: {res['path']}")
    from fidelity.kld.twin import flagged
    return exit_code(flagged(res["verdict"]))


def _health_lines(res) -> None:
    """Retries and incomplete capture coverage, printed even with --quiet: numbers computed
    on fewer prompts, or after retries, should never pass unnoticed."""
    from fidelity.kld.health import incomplete, retry_line
    if res["retries"]:
        print(retry_line(res["retries"]))
    for _, r in incomplete(res["coverage"]).iterrows():
        print(f"warning: {r.arm}: {r.captures} captures ({r.signals}) on {r.prompts} of {r['of']} "
              f"prompts" + (f": {r.missing_because}" if r.missing_because else ""), file=sys.stderr)
