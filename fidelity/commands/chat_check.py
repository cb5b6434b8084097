"""`fidelity chat-check`: does the engine render chat requests the way DeepSeek does?
Heavy modules (torch, the tokenizer, httpx) are imported inside run(): `fidelity --help`
imports every command module and stays quick."""
from __future__ import annotations

import time

from infra.command import command_line
from fidelity.commands.options import api_key, chat_encoding, endpoint_url, http_options, output_options
from fidelity.errors import CommandError

HELP = ("Check that an engine renders chat requests (system, tools, thinking, reasoning effort, "
        "multi-turn, tool results) exactly as DeepSeek's own encoder does, and reads the tool calls "
        "its model writes; exit 1 on any undocumented difference.")
EXAMPLES = """\
    fidelity chat-check --endpoint http://127.0.0.1:30000 --engine-profile sglang   # exit 1 on an undocumented difference
    fidelity chat-check --endpoint http://127.0.0.1:30000 --chat-version v41        # a DeepSeek-V4.1 deployment
"""


def add_arguments(p):
    p.add_argument("--endpoint", required=True, metavar="URL", type=endpoint_url, help="the server (root or /v1 URL)")
    p.add_argument("--model", default=None,
                   help="served model to check (default: the only one served; a server serving several "
                        "needs it)")
    p.add_argument("--generation", choices=("0731", "original"), default="0731",
                   help="DeepSeek-V4 checkpoint generation of the reference's effort tiers (docs/research/dsv4-architecture.md §3.2)")
    p.add_argument("--chat-version", choices=("auto", "v4", "v41"), default="auto",
                   help="model whose chat encoding is the reference: v4 (DeepSeek-V4) or v41 "
                        "(DeepSeek-V4.1: spaced DSML tags, <｜System｜>, numeric reasoning effort; "
                        "tool calls read in V4.1's DSML); auto (default): v41 when the server "
                        "names a V4.1 model (architecture, model path or id), else v4")
    p.add_argument("--engine-profile", choices=("sglang", "vllm"), default=None,
                   help="differences this engine is documented to make count as 'documented', not "
                        "failures, and those cases' responses are judged against the documented "
                        "reading (e.g. SGLang's default thinking off: no reasoning_content expected)")
    p.add_argument("--tokenizer", default=None,
                   help="the served model's tokenizer.json: checks the engine's tokenizer and stands "
                        "in when the engine has no tokenize route (default: the embedded one)")
    p.add_argument("--no-behaviour", action="store_true",
                   help="skip the short completions (reasoning_content present, tool round trip)")
    http_options(output_options(p, "chat-check", "chat-check-<timestamp>"))


def run(args) -> int:
    from infra.http import RetryPolicy
    from fidelity.chat_check import report
    from fidelity.chat_check.cases import all_cases
    from fidelity.chat_check.check import (TokenizerMismatch, behaviour, check_specials, expected_reading,
                                           known_readings, profile_numerics, run_case)
    from fidelity.chat_check.probe import WEAK, ChatProbe, ProbeError
    from fidelity.chat_check.version import served_chat_version
    from fidelity.kld.endpoint import Endpoint, EndpointError
    from fidelity.progress import Progress
    from reference_model.tokenizer import load_tokenizer

    if args.chat_version != "auto":
        chat_encoding(args.chat_version, args.generation)     # a bad combination fails before connecting
    progress = Progress(args.quiet)
    try:
        tok = load_tokenizer(args.tokenizer) if args.tokenizer else None
        ep = Endpoint("engine", args.endpoint, "openai", args.model,
                      RetryPolicy(retries=args.retries, timeout=args.timeout),
                      on_retry=progress.log, api_key=api_key(args)).connect()
        version, why = (args.chat_version, "given") if args.chat_version != "auto" else served_chat_version(ep.info)
        if args.chat_version == "auto":
            print(f"chat version {version} ({why}; --chat-version overrides)")
        generation = chat_encoding(version, args.generation)
        probe = ChatProbe(ep, tok or load_tokenizer())
        cases = all_cases()
        prof = profile_numerics(args.engine_profile)
        readings = known_readings()
        check_specials(probe, generation)
        rows = []
        with progress.task("chat-check", len(cases)) as advance:
            for c in cases:
                row = run_case(c, probe, generation, prof, readings)
                if not args.no_behaviour and (c.kind != "matrix" or (c.effort is None and not c.tags["system"])):
                    row["behaviour"] = behaviour(c, probe, *expected_reading(c, row, generation, prof))
                rows.append(row)
                advance(1, c.id)
    except (EndpointError, ProbeError, TokenizerMismatch, ValueError) as e:
        raise CommandError(str(e)) from None
    meta = {"endpoint": ep.describe(), "server": ep.info, "generation": args.generation,
            "chat_version": version, "chat_version_from": why,
            "engine_profile": args.engine_profile, "method": probe.method,
            "weak": probe.method == WEAK, "raw_tokenizer": probe.raw_route or f"local {probe.local.name}",
            "command": command_line()}
    path, failed = report.write(rows, meta, args.out, args.run_id or time.strftime("chat-check-%Y%m%d-%H%M%S"))
    counts = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
          + (f"; behaviour problems {sum(1 for r in rows if r.get('behaviour', 'ok') != 'ok')}" if not args.no_behaviour else ""))
    if probe.method == WEAK:
        print("note: the engine exposes no prompt token ids; counts only (a weaker check)")
    print(f"report: {path}")
    return 1 if failed else 0

