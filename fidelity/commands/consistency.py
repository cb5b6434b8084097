"""`fidelity consistency`: does a live engine give the same answer however the request is
served? Heavy modules are imported inside run(): `fidelity --help` stays quick."""
from __future__ import annotations

import sys

from fidelity.commands.options import api_key, endpoint_pair, http_options, output_options, retired
from fidelity.errors import CommandError

HELP = ("Probe live endpoints under serving conditions (prefix-cache hits at each boundary "
        "class, other requests in flight) and name the condition that changes the answer; "
        "exit 1 when one does.")
EXAMPLES = """\
    fidelity consistency --endpoint engine=http://127.0.0.1:30000
    fidelity consistency --endpoint a=http://127.0.0.1:30000 --model a=golden --probes 5 --length 512
    fidelity consistency --endpoint engine=http://127.0.0.1:30000 --families batch --concurrency 1,8,32,64
"""


DEFAULT_FAMILIES = "prefix,batch"          # + chunk,longgen with --arm


def add_arguments(p):
    from fidelity.consistency.batch import BatchPlan
    from fidelity.consistency.longgen import LongGenPlan
    from fidelity.consistency.prefix import PrefixPlan
    g = p.add_argument_group("arms")
    g.add_argument("--endpoint", action="append", default=[], metavar="NAME=URL", type=endpoint_pair,
                   help="a running server (root or /v1 URL; repeatable)")
    g.add_argument("--dialect", action="append", default=[], metavar="NAME=DIALECT",
                   help="force an endpoint's dialect: sglang, vllm or openai (default: detected)")
    g.add_argument("--model", action="append", default=[], metavar="[ARM=]MODEL",
                   help="served model an endpoint arm queries (as in `fidelity kld`)")
    retired(g, "--inprocess", "--arm", "inprocess", metavar="NAME=ARM")
    g.add_argument("--arm", dest="inprocess", default=None, metavar="NAME=ARM",
                   help="a reference computed here in one piece (e.g. golden=golden) for the "
                        "chunk family")
    g.add_argument("--checkpoint", default=None,
                   help="whose tokenizer and config build the probes (default: the embedded model)")
    g.add_argument("--tokenizer", default=None, help="tokenizer.json the probes are built with")
    g = p.add_argument_group("probes")
    g.add_argument("--families", default=None,
                   help="comma-separated probe families: prefix (cache hits vs cold), batch "
                        "(alone vs in company), spec (speculation on vs --spec-baseline), chunk (KL along the prompt vs --arm, at the "
                        "prefill chunk boundaries), longgen (long generations scored by --arm "
                        f"teacher-forced) (default: {DEFAULT_FAMILIES}, and chunk,longgen with --arm)")
    g.add_argument("--probes", type=int, default=None,
                   help=f"probe prompts per family (default: prefix {PrefixPlan.probes}, batch {BatchPlan.probes})")
    g.add_argument("--length", action="append", default=[], metavar="[FAMILY=]N",
                   help=f"probe prompt length in tokens, for every family or one (repeatable: "
                        f"--length chunk=400) (default: prefix {PrefixPlan.length}, batch "
                        f"{BatchPlan.length}, chunk 1.5 prefill chunks)")
    g.add_argument("--max-tokens", type=int, default=None,
                   help=f"greedy tokens compared per reply (default: prefix {PrefixPlan.max_tokens}, "
                        f"batch {BatchPlan.steps})")
    g.add_argument("--top-k", type=int, default=PrefixPlan.k,
                   help="logprobs per position (default: %(default)s)")
    g.add_argument("--seed", type=int, default=PrefixPlan.seed, help="probe prompts' seed")
    g.add_argument("--page-size", type=int, default=None,
                   help="the engine's prefix-cache page, when /get_server_info does not report it")
    g.add_argument("--chunk-size", type=int, default=None,
                   help="the engine's prefill chunk, when /get_server_info does not report it")
    g.add_argument("--evict-tokens", type=int, default=None,
                   help="prefix family: tokens of other prompts sent to evict the cache before the "
                        "`evicted` condition (default: 1.25 x max_total_num_tokens when the server "
                        "reports it; else the condition is skipped)")
    g.add_argument("--concurrency", default=",".join(map(str, BatchPlan.concurrency)),
                   help="batch family: filler requests in flight beside the probe (default: %(default)s)")
    g.add_argument("--repeats", type=int, default=BatchPlan.repeats,
                   help="batch family: repeats per probe and concurrency (default: %(default)s)")
    g.add_argument("--gen-tokens", type=int, default=LongGenPlan.max_tokens,
                   help="longgen family: tokens generated per probe (default: %(default)s)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="longgen family: generate --gen-tokens even past EOS (a model that answers "
                        "and stops early; early EOS is then not measured)")
    g.add_argument("--spec-baseline", default=None, metavar="NAME",
                   help="spec family: the --endpoint serving the same model without speculative "
                        "decoding, compared with every other arm (giving it adds spec to the "
                        "default families)")
    g.add_argument("--spec-seeds", type=int, default=None,
                   help="spec family: sampled replies per probe and arm for the distribution test "
                        "(default 8)")
    g.add_argument("--spec-temperature", type=float, default=None,
                   help="spec family: temperature of its sampled replies (default 1.0)")
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
    key = api_key(args)
    arms = [LiveArm(Endpoint(name, url, dialects.pop(name, None), per_arm.get(name, every), policy,
                             target.tokenizer, on_retry=progress.log, api_key=key)) for name, url in endpoints]
    if dialects:
        raise ValueError(f"--dialect names no endpoint: {', '.join(dialects)}")
    return arms


def _settings(args):
    """The families and their plans from the options (a plan's own default where not given)."""
    from dataclasses import replace

    from fidelity.consistency.batch import BatchPlan
    from fidelity.consistency.chunk import ChunkPlan
    from fidelity.consistency.longgen import LongGenPlan
    from fidelity.consistency.prefix import PrefixPlan
    from fidelity.consistency.run import ConsistencySettings
    from fidelity.consistency.spec import SpecPlan
    given = lambda **kw: {k: v for k, v in kw.items() if v is not None}       # noqa: E731
    _at_least(args)
    length = _lengths(args.length)
    prefix = replace(PrefixPlan(), k=args.top_k, seed=args.seed, page_size=args.page_size,
                     chunk_size=args.chunk_size, evict_tokens=args.evict_tokens,
                     **given(probes=args.probes, length=length["prefix"], max_tokens=args.max_tokens))
    try:
        conc = tuple(int(x) for x in args.concurrency.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--concurrency {args.concurrency!r}: expected comma-separated integers") from None
    if not conc or min(conc) < 1 or args.repeats < 1:
        raise ValueError("--concurrency needs integers >= 1 and --repeats at least 1")
    batch = replace(BatchPlan(), k=args.top_k, seed=args.seed, concurrency=conc, repeats=args.repeats,
                    **given(probes=args.probes, length=length["batch"], steps=args.max_tokens))
    chunk = replace(ChunkPlan(), k=args.top_k, seed=args.seed, chunk_size=args.chunk_size,
                    **given(probes=args.probes, length=length["chunk"]))
    longgen = replace(LongGenPlan(), k=args.top_k, seed=args.seed, max_tokens=args.gen_tokens,
                      ignore_eos=args.ignore_eos, **given(probes=args.probes))
    if args.spec_seeds is not None and args.spec_seeds < 2:
        raise ValueError(f"--spec-seeds {args.spec_seeds}: the distribution test needs at least 2")
    if args.spec_temperature is not None and args.spec_temperature <= 0:
        raise ValueError(f"--spec-temperature {args.spec_temperature:g}: must be > 0 (greedy is always compared)")
    spec = replace(SpecPlan(), k=args.top_k, seed=args.seed, baseline=args.spec_baseline,
                   **given(probes=args.probes, length=length["spec"], max_tokens=args.max_tokens,
                           seeds=args.spec_seeds, temperature=args.spec_temperature))
    text = args.families or (DEFAULT_FAMILIES + (",chunk,longgen" if args.inprocess else "")
                             + (",spec" if args.spec_baseline else ""))
    families = tuple(f.strip() for f in text.split(",") if f.strip())
    return ConsistencySettings(families, prefix, batch, chunk, longgen, spec)


LENGTH_FAMILIES = ("prefix", "batch", "chunk", "spec")        # the families whose probe prompts have a length


def _lengths(values: list[str]) -> dict:
    """--length values ('N' for every family, 'FAMILY=N' for one, later ones winning) as
    {family: N or None}."""
    out = dict.fromkeys(LENGTH_FAMILIES)
    for v in values:
        fam, sep, n = v.rpartition("=")
        fams = [fam.strip()] if sep else list(LENGTH_FAMILIES)
        if sep and fams[0] not in LENGTH_FAMILIES:
            raise ValueError(f"--length {v!r}: {fams[0]!r} is not a family with a prompt length "
                             f"({', '.join(LENGTH_FAMILIES)}; longgen's prompts are chat tasks)")
        try:
            n = int(n)
        except ValueError:
            raise ValueError(f"--length {v!r}: expected N or FAMILY=N, N a number of tokens") from None
        if n < 1:
            raise ValueError(f"--length {v!r}: a prompt needs at least 1 token")
        out.update(dict.fromkeys(fams, n))
    return out


def _at_least(args) -> None:
    """Sizes and counts that must be positive (0 or less is a mistake, never "off")."""
    for opt, least in (("page_size", 1), ("chunk_size", 1), ("probes", 1), ("max_tokens", 1),
                       ("evict_tokens", 1), ("gen_tokens", 1), ("top_k", 0), ("repeats", 1),
                       ("retries", 0)):
        v = getattr(args, opt)
        if v is not None and v < least:
            raise ValueError(f"--{opt.replace('_', '-')} {v}: must be at least {least}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout {args.timeout:g}: must be a positive number of seconds")


def _reference(spec: str | None, target):
    """The in-process reference scorer of --arm NAME=ARM (None without it)."""
    if spec is None:
        return None
    from fidelity.design.arms import parse_arm
    from fidelity.cli import name_value_pairs
    from fidelity.scores.inprocess import InProcessScorer
    from kernel_toggles.arms import version_of
    (name, text), = name_value_pairs([spec], "--arm", "ARM")
    arm = parse_arm(text, version_of(target.cfg))
    return InProcessScorer(name, arm.numerics(), target.weights, arm.name, schedule=arm.schedule)


def run(args) -> int:
    from fidelity.consistency.run import run_consistency, store_path
    from fidelity.kld.endpoint import EndpointError
    from fidelity.progress import Progress
    from fidelity.weights.target import load_target
    progress = Progress(args.quiet)
    try:
        settings = _settings(args)
        target = load_target(args.checkpoint, args.tokenizer)
        arms = _arms(args, target, progress)
        if args.fresh:
            store_path(args.out).unlink(missing_ok=True)
        res = run_consistency(arms, target, settings, args.out, args.run_id, progress,
                              _reference(args.inprocess, target),
                              identity=args.checkpoint is not None or args.inprocess is not None)
    except (ValueError, RuntimeError, EndpointError) as e:
        raise CommandError(str(e)) from None
    for line in res["verdict"]:
        print(line)
    print(f"report: {res['path']}", file=sys.stderr if args.quiet else sys.stdout)
    return 1 if res["flagged"] else 0
