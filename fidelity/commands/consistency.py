"""`fidelity consistency`: does a live engine give the same answer however the request is
served? Heavy modules are imported inside run(): `fidelity --help` stays quick."""
from __future__ import annotations

import sys

from fidelity.commands.options import http_options, output_options
from fidelity.errors import CommandError

HELP = ("Probe live endpoints under serving conditions (prefix-cache hits at each boundary "
        "class) and name the condition that changes the answer; exit 1 when one does.")
EXAMPLES = """\
    fidelity consistency --endpoint engine=http://127.0.0.1:30000
    fidelity consistency --endpoint a=http://127.0.0.1:30000 --model a=golden --probes 5 --length 512
"""


def add_arguments(p):
    from fidelity.consistency.prefix import PrefixPlan
    g = p.add_argument_group("arms")
    g.add_argument("--endpoint", action="append", default=[], metavar="NAME=URL",
                   help="a running server (root or /v1 URL; repeatable)")
    g.add_argument("--dialect", action="append", default=[], metavar="NAME=DIALECT",
                   help="force an endpoint's dialect: sglang, vllm or openai (default: detected)")
    g.add_argument("--model", action="append", default=[], metavar="[ARM=]MODEL",
                   help="served model an endpoint arm queries (as in `fidelity kld`)")
    g.add_argument("--checkpoint", default=None,
                   help="whose tokenizer and config build the probes (default: the embedded model)")
    g.add_argument("--tokenizer", default=None, help="tokenizer.json the probes are built with")
    g = p.add_argument_group("probes")
    g.add_argument("--families", default="prefix", help="comma-separated probe families (default: prefix)")
    g.add_argument("--probes", type=int, default=PrefixPlan.probes,
                   help="probe prompts per family (default: %(default)s)")
    g.add_argument("--length", type=int, default=PrefixPlan.length,
                   help="probe prompt length in tokens (default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=PrefixPlan.max_tokens,
                   help="greedy tokens compared per reply (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=PrefixPlan.k,
                   help="logprobs per generated token (default: %(default)s)")
    g.add_argument("--seed", type=int, default=PrefixPlan.seed, help="probe prompts' seed")
    g.add_argument("--page-size", type=int, default=None,
                   help="the engine's prefix-cache page, when /get_server_info does not report it")
    g.add_argument("--chunk-size", type=int, default=None,
                   help="the engine's prefill chunk, when /get_server_info does not report it")
    http_options(g)
    output_options(p, "consistency", "consistency-<timestamp>",
                   fresh="discard stored probes instead of resuming",
                   out_help="writes <out>/consistency/probes.jsonl (resumable) and "
                            "<out>/consistency/<run-id>/ (default: %(default)s)")


def _arms(args, target, progress):
    from infra.http import RetryPolicy, model_options
    from fidelity.cli import name_value_pairs
    from fidelity.consistency.client import LiveArm
    from fidelity.kld.endpoint import Endpoint
    endpoints = name_value_pairs(args.endpoint, "--endpoint", "URL")
    if not endpoints:
        raise ValueError("give at least one --endpoint NAME=URL")
    dialects = dict(name_value_pairs(args.dialect, "--dialect"))
    every, per_arm = model_options(args.model, [n for n, _ in endpoints])
    policy = RetryPolicy(retries=args.retries, timeout=args.timeout)
    arms = [LiveArm(Endpoint(name, url, dialects.pop(name, None), per_arm.get(name, every), policy,
                             target.tokenizer, on_retry=progress.log)) for name, url in endpoints]
    if dialects:
        raise ValueError(f"--dialect names no endpoint: {', '.join(dialects)}")
    return arms


def run(args) -> int:
    from fidelity.consistency.prefix import PrefixPlan
    from fidelity.consistency.run import ConsistencySettings, run_consistency, store_path
    from fidelity.kld.endpoint import EndpointError
    from fidelity.progress import Progress
    from fidelity.weights.target import load_target
    progress = Progress(args.quiet)
    try:
        target = load_target(args.checkpoint, args.tokenizer)
        arms = _arms(args, target, progress)
        if args.fresh:
            store_path(args.out).unlink(missing_ok=True)
        plan = PrefixPlan(args.length, args.probes, args.max_tokens, args.top_k, args.seed,
                          args.page_size, args.chunk_size)
        families = tuple(f.strip() for f in args.families.split(",") if f.strip())
        res = run_consistency(arms, target, ConsistencySettings(families, plan), args.out, args.run_id,
                              progress)
    except (ValueError, RuntimeError, EndpointError) as e:
        raise CommandError(str(e)) from None
    for line in res["verdict"]:
        print(line)
    print(f"report: {res['path']}", file=sys.stderr if args.quiet else sys.stdout)
    return 1 if res["conditions"].flagged.any() else 0
