"""`fidelity ab`: the main command (golden vs engine numerics, drift report)."""
from __future__ import annotations

import sys

from fidelity.commands.options import output_options, retired
from fidelity.errors import CommandError, exit_code
from fidelity.design.lengths import HELP as LENGTHS_HELP
from fidelity.design.lengths import argtype as lengths_arg

HELP = "A/B: golden vs engine numerics layer by layer, attribution to toggles, report."
EXAMPLES = """\
    fidelity ab                                     # the embedded model: golden, floors, every toggle, the engine
    fidelity ab --checkpoint /models/DeepSeek-V4-Flash --devices cuda:0,cuda:1,cuda:2,cuda:3 --long
    fidelity ab --arm engine --arm engine-wo_a_fp8 --vs engine   # does removing wo_a_fp8 from the engine explain it?
    fidelity ab --arm 'engine@prefix_hit(128)' --arm 'engine,chunk_stale_index_keys@chunked(64)'   # serving state
    fidelity ab --distributed --checkpoint /models/DeepSeek-V4-Pro   # each rank of `torchrun --nnodes 2 --nproc-per-node 8 ... -m fidelity ab --distributed` (docs/distributed.md)
"""


def add_arguments(p):
    p.add_argument("--checkpoint", help="DeepSeek-native checkpoint dir (default: embedded tiny model)")
    p.add_argument("--weights", action="append", default=[], metavar="NAME=DIR",
                   help="another checkpoint of the same architecture as an arm 'weights:NAME' "
                        "(golden numerics on it; repeatable). Without --checkpoint the first "
                        "--weights is the base the others are compared with")
    retired(p, "--arms", "--arm", "arms", append=True, metavar="ARM")
    p.add_argument("--arm", dest="arms", action="append", metavar="ARM",
                   help="an arm in DSV4_FIDELITY_ARM syntax, e.g. 'engine,routed_scaling_double', "
                        "optionally @SCHEDULE ('engine@prefix_hit(128)') (repeatable; default: each "
                        "optimization, engine, engine minus each)")
    p.add_argument("--base", default="engine", help="arm whose leave-one-out is computed (default engine)")
    p.add_argument("--mode", choices=("propagated", "isolated"), default="propagated",
                   help="propagated: each arm feeds itself (the drift it accumulates); isolated: each "
                        "arm's layer i gets golden's input to layer i (that layer's own error) "
                        "(default: %(default)s)")
    p.add_argument("--lengths", type=lengths_arg, default=None, metavar="L,L|boundaries[:MAX]",
                   help="prompt lengths, e.g. 250,511 (default 250,511: residues 2 and 3 mod 4), "
                        + LENGTHS_HELP)
    p.add_argument("--long", action="store_true",
                   help="long-context preset: lengths 250,511,2047 (each CSA layer then picks "
                        "index_topk among up to 32x as many entries on the tiny model)")
    p.add_argument("--schedule", default=None, metavar="S",
                   help="feed every toggle arm's prompts as a serving engine would: chunked(N), "
                        "prefix_hit(P) (a prefix-cache hit at P), decode_from(P) (the rest through "
                        "the decode path); an arm's own ARM@S overrides; golden under S becomes the "
                        "floor floor:schedule@S")
    retired(p, "--prompts-per-length", "--reps", "prompts_per_length", type=int)
    p.add_argument("--reps", dest="prompts_per_length", type=int, default=None,
                   help="built-in prompts per length (default 9, fidelity.ab.design.PromptPlan: "
                        "enough trials for the exact test of a needle-entry loss in 1 of 5)")
    p.add_argument("--prompts", metavar="FILE.jsonl",
                   help="your own prompts instead of the built-in haystacks: one JSON per line "
                        "with text, messages (chat) or token_ids (same file as fidelity kld)")
    p.add_argument("--decode-steps", type=int, default=4,
                   help="teacher-forced decode steps after each prefill, on golden's greedy tokens, so "
                        "decode-only kernels are measured too (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the built-in prompts (haystacks, needles) and of the bootstrap "
                        "(default: %(default)s)")
    p.add_argument("--shapley-top", type=int, default=3,
                   help="exact Shapley over this many most effective toggles (factorial stage; 0 = off)")
    p.add_argument("--n-boot", type=int, default=1000,
                   help="bootstrap resamples over prompts for every confidence interval "
                        "(default: %(default)s)")
    p.add_argument("--floor-k", type=float, default=2.0, help="first divergence: drift > k × floor")
    p.add_argument("--vs", metavar="ARM",
                   help="also report each arm's first divergence against this arm (one of the "
                        "arms, e.g. engine for engine,<bug> arms); default: golden only")
    p.add_argument("--keep", action="append", default=[], metavar="TAP",
                   help="also save these taps' full tensors (glob, e.g. 'layers.3.attn.*')")
    p.add_argument("--activation-budget", default=None, metavar="BYTES",
                   help="residual streams kept in memory per layer pass, e.g. 8GB; beyond it "
                        "they wait on disk (default: no limit)")
    from fidelity.weights.devices import add_options
    add_options(p)
    p.add_argument("--distributed", nargs="?", const=0, type=int, default=None, metavar="RANKS",
                   help="run as one pipeline stage of a torchrun launch (torchrun ... -m fidelity ab "
                        "--distributed): each rank runs its contiguous layers, rank 0 writes the "
                        "report; RANKS, if given, must equal torchrun's world size (docs/distributed.md)")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="with --distributed: each rank's memory budget (e.g. 96GB) for the stage "
                        "memory check before the run; default: each GPU's total memory, no check on CPU")
    p.add_argument("--dist-timeout", type=float, default=600, metavar="S",
                   help="seconds to wait for the other ranks at any exchange before failing (default 600)")
    output_options(p, "", "ab-<timestamp>", quiet=False)


def run(args) -> int:
    from fidelity.ab.design import LONG_LENGTHS, ABSettings, PromptPlan
    from fidelity.ab.run import ReportTarget, RunSite, run_ab
    from fidelity.weights.source import load_tokenizer_for, load_weights

    from fidelity.weights.devices import DeviceError, from_args
    try:
        place = from_args(args)
    except DeviceError as e:
        raise CommandError(str(e)) from None
    from fidelity.cli import name_value_pairs
    try:
        variants = name_value_pairs(args.weights, "--weights", "DIR")
    except ValueError as e:
        raise CommandError(str(e)) from None
    if not args.checkpoint and variants:
        args.checkpoint = variants.pop(0)[1]
    mode = args.weights_mode or "streamed"
    stage = _stage(args, mode) if args.distributed is not None else None
    layers = stage.layers if stage is not None else None
    devices = [str(stage.device)] if stage is not None and stage.device.type == "cuda" else place.model_devices
    weights, label = load_weights(args.checkpoint, mode=mode, devices=devices, layers=layers)
    others = {n: load_weights(path, mode=mode, devices=devices, layers=layers)[0] for n, path in variants}
    for n, w in others.items():
        diff = weights.cfg.differences(w.cfg)
        if diff:
            raise CommandError(f"--weights {n}: another architecture than {args.checkpoint} "
                               f"(config differs in {', '.join(diff)})")
    tokenizer = load_tokenizer_for(args.checkpoint)
    if args.long and args.lengths or args.prompts and (args.long or args.lengths):
        raise CommandError("give one of --long, --lengths, --prompts")
    lengths = LONG_LENGTHS if args.long else (_resolve_lengths(args.lengths, weights.cfg, tokenizer)
                                              if args.lengths else PromptPlan.lengths)
    from fidelity.weights.sizes import parse_bytes
    try:
        budget = parse_bytes(args.activation_budget) if args.activation_budget else None
    except (DeviceError, ValueError) as e:
        raise CommandError(str(e)) from None
    per_length = args.prompts_per_length or PromptPlan.prompts_per_length
    settings = ABSettings.of(arms=args.arms, base=args.base, mode=args.mode, lengths=lengths,
                             prompts_per_length=per_length, decode_steps=args.decode_steps,
                             seed=args.seed, shapley_top=args.shapley_top, n_boot=args.n_boot,
                             floor_k=args.floor_k, vs=args.vs, keep=tuple(args.keep), checkpoint=label,
                             prompts_file=args.prompts,
                             devices=tuple(devices) if devices else place.devices,
                             accumulate=str(place.compute_dtype).replace("torch.", ""),
                             activation_budget=budget, weights_variants=tuple(variants),
                             schedule=args.schedule)
    writer = stage is None or stage.first           # rank 0 alone prints and writes
    try:
        res = run_ab(weights, settings, ReportTarget(args.out if writer else None, args.run_id),
                     RunSite((lambda m: print(m, file=sys.stderr, flush=True)) if writer else None, stage),
                     tokenizer=tokenizer, variants=others)
    except ValueError as e:              # unknown arm/toggle, bad parameters
        raise CommandError(str(e)) from None
    finally:
        if stage is not None:
            from fidelity.pipeline.stage import shutdown
            shutdown()
    if not writer:
        return 0
    print(res["verdict"]["sentence"])
    print(res["summary"].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    if args.lengths is not None and args.lengths.boundaries:     # the grid's point: which residue breaks
        from fidelity.ab.report import residues
        by_res = residues(res["signals"], res["manifest"])[0]
        print("answer KLD by length residue (breaks: prompts at 10x or more of every floor on that prompt):")
        print(by_res.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"report: {res['path']}")
    return exit_code(bool(res["verdict"].get("named")))


def _resolve_lengths(spec, cfg, tokenizer) -> tuple[int, ...]:
    """--lengths as run: the boundary grid from the config, above the shortest haystack
    when the built-in prompts are haystacks (random tokens have no minimum)."""
    from fidelity.design.lengths import LengthsError, resolve, shortest_haystack
    try:
        from needle.haystack import LocalCounter
        lengths, _, note = resolve(spec, cfg, shortest_haystack(LocalCounter(tokenizer)) if tokenizer else 2)
    except LengthsError as e:
        raise CommandError(str(e)) from None
    if note:
        print(note, file=sys.stderr)
    return tuple(lengths)


def _stage(args, mode):
    """This rank's pipeline stage (fidelity.pipeline), from the checkpoint's config."""
    from fidelity.pipeline.stage import init_stage
    from fidelity.weights.source import checkpoint_config
    from fidelity.weights.sizes import parse_bytes
    try:
        budget = parse_bytes(args.device_memory) if args.device_memory else None
    except ValueError as e:
        raise CommandError(f"--device-memory: {e}") from None
    return init_stage(checkpoint_config(args.checkpoint), args.dist_timeout, args.distributed or None, budget)
