"""`fidelity needle`: needle-in-a-haystack recall sweeps over in-process arms of the
reference model and/or live OpenAI-compatible endpoints, with a paired A/B report.
Heavy modules (torch, the model, httpx) are imported inside the functions: `fidelity
--help` imports every command module and stays quick."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from fidelity.commands.options import api_key, endpoint_pair, http_options, output_options
from fidelity.errors import CommandError, exit_code
from fidelity.design.lengths import HELP as LENGTHS_HELP
from fidelity.design.lengths import argtype as lengths_arg

HELP = "Needle-in-a-haystack recall sweep (in-process arms and/or --endpoint servers) + report."
EXAMPLES = """\
    fidelity needle                                 # in-process: golden vs engine on the embedded model
    fidelity needle --endpoint golden=http://127.0.0.1:8000/v1 --endpoint engine=http://127.0.0.1:8001/v1 --lengths 2048,4096,8192 --reps 4
    fidelity needle --distributed --checkpoint /models/DeepSeek-V4-Pro --arm golden --lengths 65536   # each rank of `torchrun --nproc-per-node 8 -m fidelity needle --distributed ...` (docs/distributed.md)
"""

# residues 3,0,1,2,3 mod 4 and 127,0,1,2,127 mod 128; with 5 depths and golden + engine,
# 50 trials: about two minutes on 2 cores (shared) with the embedded tiny model
DEFAULT_INPROCESS_LENGTHS = [383, 384, 513, 642, 1023]
DEFAULT_ENDPOINT_LENGTHS = [2047, 4096, 8193, 16386, 32767]


def _csv(text, typ):
    return [typ(x) for x in text.split(",") if x.strip()] if text else None


def _haystack_arguments(g):
    """The needle kind and its counts (HaystackSpec)."""
    g.add_argument("--kind", default="single", choices=("single", "multikey", "multivalue", "multiquery"),
                   help="RULER needle kind: one needle; multikey: + distractor needles under other "
                        "keys; multivalue: several values for one key; multiquery: several keys, "
                        "all asked for in one question (default: %(default)s)")
    g.add_argument("--distractors", default="random", choices=("random", "near"),
                   help="multikey distractor keys: random, or near-duplicates of the queried key "
                        "(one word swapped or one spelling edit, values of the same shape)")
    g.add_argument("--n-keys", type=int, default=4,
                   help="multikey: needles (the queried one + distractors); multiquery: needles "
                        "with distinct keys (default: %(default)s)")
    g.add_argument("--n-values", type=int, default=4, help="multivalue: values for the key (default: %(default)s)")
    g.add_argument("--n-queries", type=int, default=4,
                   help="multiquery: keys asked for, at most --n-keys; the others are distractors "
                        "(default: %(default)s, RULER's niah_multiquery)")


def add_arguments(p):
    g = p.add_argument_group("what to run")
    g.add_argument("--arm", action="append", default=None, metavar="[NAME=]ARM",
                   help="in-process arm (repeatable), e.g. golden, engine, "
                        "'fp8=index_keys_fp8'; default: golden and engine")
    g.add_argument("--endpoint", action="append", default=[], metavar="NAME=URL", type=endpoint_pair,
                   help="OpenAI-compatible server as an arm (repeatable), e.g. "
                        "sglang=http://127.0.0.1:30000/v1")
    g.add_argument("--checkpoint", help="DeepSeek-native checkpoint for in-process arms")
    g.add_argument("--tokenizer", help="tokenizer.json for in-process arms")
    g.add_argument("--batch", type=int, default=None, metavar="N",
                   help="in-process arms: at most N trials of one length run together, layer-major "
                        "(each layer's weights fetched once per pass for all of them; same results); "
                        "1 = one at a time (default: all pending trials of a length, within --batch-tokens)")
    g.add_argument("--batch-tokens", type=int, default=None, metavar="T",
                   help="in-process arms: at most T prompt tokens per batch, which bounds the memory "
                        "of the residual streams and states held at once; a longer trial runs alone "
                        "(default: 65536)")
    from fidelity.weights.devices import add_options
    add_options(p)
    from fidelity.commands.options import distributed_options
    distributed_options(p.add_argument_group("distributed (docs/distributed.md; in-process trials then run one "
                                             "at a time, not in layer-major batches)"), "needle")
    g = p.add_argument_group("grid")
    g.add_argument("--lengths", type=lengths_arg, metavar="L,L|boundaries[:MAX]",
                   help="comma-separated token counts (default: in-process "
                   f"{DEFAULT_INPROCESS_LENGTHS}, endpoints {DEFAULT_ENDPOINT_LENGTHS}), " + LENGTHS_HELP
                   + "; with boundaries each length also gets needle depths just inside and just outside "
                     "the window seen from the question, where the prompt can reach them (endpoint-only "
                     "runs read the config from --checkpoint)")
    g.add_argument("--depths", default="0,25,50,75,100", help="comma-separated depth percents")
    g.add_argument("--reps", type=int, default=1, help="trials per cell (different needles)")
    _haystack_arguments(g)
    g.add_argument("--value-type", default="number", choices=("number", "word", "uuid"),
                   help="the needles' values: 7-digit numbers, adjective-noun words (e.g. "
                        "quiet-harbor) or UUIDs (default: %(default)s)")
    g.add_argument("--filler", default="essay", choices=("essay", "noise"),
                   help="haystack text: essay (the shipped corpus) or noise (RULER's repeated "
                        "noise sentences) (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="sweep seed (needles, filler start)")
    g = p.add_argument_group("requests")
    g.add_argument("--api", default="chat", choices=("chat", "completions"),
                   help="chat (DeepSeek-V4 chat encoding) or raw completions with an answer prefix")
    g.add_argument("--thinking", action="store_true", help="thinking mode (<think>)")
    g.add_argument("--reasoning-effort", default=None,
                   help="reasoning_effort sent with chat requests (and rendered in-process), e.g. "
                        "high or max (default: none sent)")
    g.add_argument("--temperature", type=float, default=None,
                   help="default: 0 (greedy) in-process, 1.0 for endpoints (DeepSeek's recommendation)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling top_p (default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="default: answer length + slack in-process; 128 (8192 thinking) for endpoints")
    g.add_argument("--no-seed", action="store_true", help="do not send per-trial seeds to endpoints")
    g.add_argument("--model", action="append", default=[], metavar="[ARM=]MODEL",
                   help="served model an endpoint arm queries (repeatable): ARM=MODEL for one "
                        "arm, a bare MODEL for the others (default: the model named like the "
                        "arm, else the only one served; a server serving several models and "
                        "none named like the arm is an error)")
    g.add_argument("--chat-template-kwargs", default=None,
                   help='JSON object sent as chat_template_kwargs, replacing the default '
                        '{"thinking": <--thinking>}; \'{}\' sends none')
    g.add_argument("--concurrency", type=int, default=4, help="requests in flight per endpoint")
    http_options(g)
    g = output_options(p, "needle", "needle-<timestamp>", fresh="discard existing results instead of resuming",
                       out_help="writes <out>/needle/results.jsonl and <out>/needle/<run-id>/ (+ latest "
                                "link) (default: %(default)s)")
    g.add_argument("--results", default=None, help="results JSONL (default <out>/needle/results.jsonl)")
    g.add_argument("--report-only", action="store_true", help="only rebuild the report from results")
    g.add_argument("--no-plots", action="store_true", help="write the report without its figures")


def _named(spec: str, default_name: str) -> tuple[str, str]:
    name, sep, rest = spec.partition("=")
    if sep and name and "(" not in name and "," not in name:
        return name.strip(), rest.strip()
    return default_name, spec.strip()


def _runners(args, driver=None):
    from fidelity.design.arms import ArmError, engine_arm, parse_arm
    from infra.http import RetryPolicy, model_options
    from needle.http import HttpRunner, RequestOptions

    notes, runners = [], []
    arm_specs = args.arm
    if arm_specs is None and not args.endpoint:
        arm_specs = ["golden"]
        if engine_arm() is not None:
            arm_specs.append("engine")
        else:
            notes.append("kernel_toggles is not available: golden arm only")
    if arm_specs:
        from fidelity.needle_run.batch import DEFAULT_BATCH_TOKENS
        batch_tokens = DEFAULT_BATCH_TOKENS if args.batch_tokens is None else args.batch_tokens
        for opt, v in (("--batch", args.batch), ("--batch-tokens", batch_tokens)):
            if v is not None and v < 1:
                raise CommandError(f"{opt} must be at least 1, got {v}")
        from fidelity.weights.devices import DeviceError, from_args
        try:
            place = from_args(args)
        except DeviceError as e:
            raise CommandError(str(e)) from None
        from fidelity.needle_run.runner import InProcessOptions, InProcessRunner
        from reference_model.generate import Sampling
        from fidelity.pipeline.model import command_target
        target = command_target(args, place, driver)
        if driver is not None:
            notes.append(f"distributed over {driver.stage.world} ranks: trials run one at a time")
        notes.append(f"in-process model: {target.description}")
        temp = 0.0 if args.temperature is None else args.temperature
        from kernel_toggles.arms import version_of
        for s in arm_specs:
            name, text = _named(s, s)
            try:
                arm = parse_arm(text, version_of(target.cfg))
            except ArmError as e:
                raise CommandError(f"--arm {s!r}: {e}") from None
            runners.append(InProcessRunner(name, target, arm, Sampling(temp, args.top_p), args.max_tokens,
                                           InProcessOptions(placement=place, batch=args.batch,
                                                            batch_tokens=batch_tokens, driver=driver)))
    kw = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else None
    endpoints = [_named(s, "") for s in args.endpoint]    # URLs checked when parsed (endpoint_pair)
    for (name, _), s in zip(endpoints, args.endpoint):
        if not name:
            raise CommandError(f"--endpoint must be NAME=URL with a plain NAME, got {s!r}")
    every, per_arm = model_options(args.model, [n for n, _ in endpoints])   # ValueError: exit 2
    if endpoints:
        api_key(args)                                   # an explicit --api-key-env that is unset: exit 2
    for name, url in endpoints:
        options = RequestOptions(temperature=1.0 if args.temperature is None else args.temperature,
                                 top_p=args.top_p, max_tokens=args.max_tokens, seed=not args.no_seed,
                                 reasoning_effort=args.reasoning_effort, chat_template_kwargs=kw)
        runners.append(HttpRunner(name, url, args.api, per_arm.get(name, every), options,
                                  RetryPolicy(retries=args.retries, timeout=args.timeout),
                                  args.concurrency, args.api_key_env))
    return runners, notes


def run(args) -> int:
    if args.distributed is None:
        return _run(args)
    if args.report_only:
        raise CommandError("--distributed runs in-process arms; --report-only runs none")
    if args.arm is None and args.endpoint:
        raise CommandError("--distributed runs the in-process arms across the ranks; give at least one --arm "
                           "(endpoint arms are queried from rank 0 as usual)")
    from fidelity.pipeline.model import run_ranks
    return run_ranks(args, lambda driver: _run(args, driver), lambda cfg: _need(args, cfg))


ANSWER_TOKENS = 64        # the memory check's answer budget when --max-tokens is not given


def _need(args, cfg):
    """What a distributed needle sweep holds at once: one trial (its longest prompt and
    answer) per in-process arm, the last position's logits."""
    from fidelity.pipeline.model import Need
    answer = args.max_tokens or ANSWER_TOKENS + (256 if args.thinking else 0)
    arms = len(args.arm) if args.arm is not None else 2
    if args.lengths is None:
        longest = max(DEFAULT_INPROCESS_LENGTHS)
    elif args.lengths.boundaries:
        from fidelity.design.lengths import resolve
        longest = max(resolve(args.lengths, cfg)[0])
    else:
        longest = max(args.lengths.lengths)
    return Need(longest + answer, arms, "last")


def _run(args, driver=None) -> int:
    """The command on one process, or on rank 0 with `driver`'s pipeline models."""
    from needle.haystack import HaystackError, HaystackSpec, PromptFormat
    from needle.report import write_report
    from needle.results import ResultsError, latest, read_rows
    from needle.sweep import SweepConfig, run_sweep
    from needle.tables import by_arm, pairs, recall_lost, specials_leaked

    out = Path(args.out) / "needle"
    results = Path(args.results) if args.results else out / "results.jsonl"
    meta = {"results": str(results)}
    if args.report_only:
        header, rows = read_rows(results)
        if header is None:
            raise CommandError(f"no results at {results}")
        order = {a["name"]: i for i, a in enumerate(header.get("arms") or [])}
        rows = sorted(latest(rows), key=lambda r: order.get(r["arm"], len(order)))
        meta.update({"trials": header.get("trials"), "arms": header.get("arms")})
    else:
        try:
            runners, notes = _runners(args, driver)
        except ValueError as e:
            raise CommandError(str(e)) from None
        spec = HaystackSpec(args.kind, args.value_type, args.filler, n_keys=args.n_keys,
                            n_values=args.n_values, n_queries=args.n_queries, distractors=args.distractors)
        fmt = PromptFormat("chat" if args.api == "chat" else "completion", args.thinking, args.reasoning_effort)
        try:
            lengths, length_depths, bounds = _grid(args, runners, spec, fmt, notes)
        except (HaystackError, ValueError) as e:
            raise CommandError(str(e)) from None
        from fidelity.design.arms import check_schedules
        try:                                  # in-process arms prefill all but the last token
            check_schedules({r.name: r.arm.schedule for r in runners if hasattr(r, "arm")}, lengths, 1)
        except ValueError as e:
            raise CommandError(str(e)) from None
        try:
            cfg = SweepConfig(lengths=lengths, depths=_csv(args.depths, float), reps=args.reps,
                              spec=spec, fmt=fmt, seed=args.seed, length_depths=length_depths)
            for n in notes:
                print(n, file=sys.stderr)
            rows = run_sweep(cfg, runners, results, fresh=args.fresh, quiet=args.quiet)
        except (HaystackError, ResultsError, ValueError) as e:
            raise CommandError(str(e)) from None
        meta["retries"] = _retries(runners, rows)
        if bounds is not None:
            meta["boundaries"] = bounds
        if length_depths:
            meta["window_depths"] = {str(k): v for k, v in length_depths.items()}
        meta.update({"notes": notes, "lengths": lengths, "depths": cfg.depths, "reps": cfg.reps,
                     "trials": {"spec": cfg.spec.to_dict(), "format": cfg.fmt.to_dict(),
                                "seed": cfg.seed},
                     "arms": [r.describe() for r in runners]})
    path = write_report(rows, out, meta, run_id=args.run_id, with_plots=not args.no_plots)
    arms = by_arm(rows)
    for a in arms:
        rec = "-" if a["recall"] is None else f"{a['recall']:.3f} [{a['ci_low']:.3f}, {a['ci_high']:.3f}]"
        print(f"{a['arm']:>16}: recall {rec} over {a['n_scored']} scored trials; "
              f"truncated {a['truncated']}, server errors {a['server_error']}")
    for p in pairs(rows):
        if p["scope"] == "all":
            print(f"{p['arm_a']} - {p['arm_b']}: {p['delta']:+.3f} over {p['n_pairs']} pairs, "
                  f"McNemar p={p['p_value']:.3g} ({p['test']})")
    if meta.get("retries"):                  # even with --quiet: never pass unnoticed
        print("retries: " + "; ".join(f"{a} {r['startup'] + r['trials']} (start-up {r['startup']}, "
                                      f"trials {r['trials']})" for a, r in meta["retries"].items()))
    print(f"report: {path}")
    for a in arms:
        if a["bos_replies"]:                 # even with --quiet: a NaN row's argmax, never noise
            print(f"{a['arm']}: BOS in {a['bos_replies']} of {a['n']} replies "
                  f"({a['bos_reasoning_only']} only in reasoning_content)")
    return exit_code(bool(recall_lost(rows)) or bool(specials_leaked(arms)))


def _grid(args, runners, spec, fmt, notes) -> tuple[list[int], dict, dict | None]:
    """Lengths, extra needle depths per length and the model's boundaries (None when no
    config is known). --lengths boundaries derives the grid from the in-process model's
    config (or --checkpoint's), above the shortest haystack, and adds per length the
    depths that put the needle just inside / outside the sliding window seen from the
    question (fidelity.design.lengths), when a local tokenizer can measure the prompt's parts."""
    from dataclasses import asdict

    from fidelity.design.lengths import Boundaries, needle_window_depths, resolve, shortest_haystack
    target = next((r.target for r in runners if hasattr(r, "target")), None)
    cfg = target.cfg if target is not None else None
    if cfg is None and args.checkpoint:
        from fidelity.weights.source import checkpoint_config
        cfg = checkpoint_config(args.checkpoint)
    spec_l = args.lengths
    if spec_l is None or not spec_l.boundaries:
        lengths = list(spec_l.lengths) if spec_l is not None else (
            DEFAULT_ENDPOINT_LENGTHS if args.endpoint and args.arm is None else DEFAULT_INPROCESS_LENGTHS)
        return lengths, {}, asdict(Boundaries.of(cfg)) if cfg is not None else None
    if cfg is None:
        raise ValueError(f"--lengths {spec_l} derives lengths from the model's config: give --checkpoint "
                         "(a folder with the model's config.json; no weights are read) or an in-process --arm")
    tok = target.tokenizer if target is not None else None
    if tok is None and args.checkpoint:
        from fidelity.weights.source import load_tokenizer_for
        tok = load_tokenizer_for(args.checkpoint)
    from needle.haystack import LocalCounter
    lengths, _, note = resolve(spec_l, cfg, shortest_haystack(LocalCounter(tok), spec, fmt) if tok else 2)
    if note:
        notes.append(note)
    b = Boundaries.of(cfg)
    extra = {}
    if tok is not None:
        base, tail = _no_filler(tok, spec, fmt)
        for L in lengths:
            extra[L] = tuple(d for d, _ in needle_window_depths(L, b.window, base, tail))
        notes.append(f"window-edge needle depths (window {b.window}; {tail} tokens follow a needle right "
                     "before the question): " + ", ".join(f"{L}: {'/'.join(f'{d:g}' for d in ds) or '-'}" for L, ds in extra.items()))
    return lengths, {L: ds for L, ds in extra.items() if ds}, asdict(b)


def _no_filler(tok, spec, fmt) -> tuple[int, int]:
    """Tokens of the prompt with no filler, and how many follow the needle's value there
    (its distance from the last token when the needle sits right before the question)."""
    from needle.haystack import probe_prompts, value_token_positions
    p = probe_prompts(spec, fmt, 0)[0]
    ids, offsets = tok.encode_with_offsets(p.text)
    pos = value_token_positions(offsets, p.value_spans)
    return len(ids), len(ids) - 1 - max(pos)


def _retries(runners, rows) -> dict:
    """Per arm with any: this run's start-up retries (model list, /tokenize, calibration
    probes) and the retries behind its trial rows (attempts beyond the first)."""
    out = {}
    for r in runners:
        startup = getattr(r, "startup_retries", 0)
        trials = sum((x.get("attempts") or 1) - 1 for x in rows if x["arm"] == r.name)
        if startup or trials:
            out[r.name] = {"startup": startup, "trials": trials}
    return out
