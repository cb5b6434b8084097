"""`fidelity llamacpp`: llama.cpp (the pinned build, `make llama-cpp`) against the golden.

  prepare   the checkpoint's GGUF (widened first when llama.cpp cannot load it as is)
  replay    llama.cpp's intermediate tensors vs the golden's taps, layer by layer: the first
            departure and the in-process arm that reproduces it
  kld-base  write the golden's logits as a `llama-perplexity --kl-divergence-base` file, or
            (--compare FILE) score a logits file llama.cpp wrote against the golden
  history   other llama.cpp builds from PyPI, each scored against the golden and its twin,
            compared with each other, a change bisected and placed at its first tensor
            (fidelity.llamacpp.history)"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from fidelity.errors import CommandError, exit_code

HELP = "llama.cpp against the golden: GGUF, tensor replay, llama-perplexity's KLD file"
EXAMPLES = """\
    fidelity llamacpp prepare --fp8 f32                 # the embedded model as GGUF (after make llama-cpp)
    fidelity llamacpp replay --fp8 f32 --tokens 240     # where llama.cpp departs, per tensor
    fidelity llamacpp replay --fp8 f32 --search         # ... and which toggle added to its twin explains it
    fidelity llamacpp kld-base --out golden.kld --ctx 128 --chunks 4   # for llama-perplexity --kl-divergence
    fidelity llamacpp kld-base --compare engine.kld     # a file llama-perplexity wrote
    fidelity llamacpp history --builds 9905,10502,11003,11434    # builds from PyPI, scored and compared
    fidelity llamacpp history --bisect 9905..10502      # the first PyPI build that changes the numbers
"""
FP8 = ("f32", "q8_0")
# what each isolated block is fed and compared on (fidelity.llamacpp.replay)
ISOLATED = {"attention": "attn_norm, and its indexer picks; vs attn_out",
            "mHC": "the stream after attention; vs the FFN site's collapse, post and comb",
            "router": "ffn_norm and the token ids; vs its routing weights",
            "MoE": "ffn_norm, its experts and routing weights; vs ffn_out"}


def add_arguments(p):
    p.add_argument("action", choices=("prepare", "replay", "kld-base", "history"))
    p.add_argument("--checkpoint", default=None, help="DeepSeek-native checkpoint (default: the embedded model)")
    p.add_argument("--fp8", choices=FP8, default="q8_0",
                   help="GGUF type of the FP8 weights: q8_0 (what llama.cpp's converter writes) or f32 "
                        "(the dequantised values, exactly)")
    p.add_argument("--gguf", default=None, help="replay: this GGUF instead of converting the checkpoint")
    p.add_argument("--tokens", type=int, default=240, help="replay: prompt length in tokens")
    p.add_argument("--prompt", default=None, metavar="ID",
                   help="replay: one prompt of `fidelity kld`'s grid by its id (e.g. L511-d90-r0, built with "
                        "--seed) instead of a --tokens-long haystack: where a kld finding sits")
    p.add_argument("--seed", type=int, default=0, help="replay --prompt: the kld run's --seed (default 0)")
    p.add_argument("--path", choices=("prefill", "decode"), default="prefill",
                   help="replay: one batch, or one token per step (llama-server's cached-prefix path)")
    p.add_argument("--ctx", type=int, default=128, help="kld-base: tokens per chunk (llama-perplexity -c)")
    p.add_argument("--chunks", type=int, default=4, help="kld-base: chunks written")
    p.add_argument("--text", default=None, help="kld-base: text file (default: generated haystack text)")
    p.add_argument("--compare", default=None, metavar="FILE",
                   help="kld-base: score this llama.cpp logits file against the golden instead of writing one")
    p.add_argument("--cache-type", choices=("f16", "q8_0"), default="f16",
                   help="replay: llama.cpp's KV cache type (llama-server's -ctk/-ctv; f16 is its default)")
    p.add_argument("--arm", action="append", default=[], metavar="PROFILE:ARM",
                   help="replay: also compare this in-process arm, a profile (reference|exact) and an "
                        "arm spelling, e.g. exact:kv_cache_ggml(type=q8_0) (repeatable; golden, the "
                        "fp32-accumulation floor, exact and the llama.cpp CPU arms for --cache-type are always "
                        "compared)")
    p.add_argument("--search", type=int, nargs="?", const=2, default=0, metavar="STEPS",
                   help="replay: where llama.cpp departs from its twin, try each registered toggle added to the "
                        "twin and keep the one that moves the departure furthest, up to STEPS toggles (default 2): "
                        "names the arithmetic (or the bug's kind) behind it")
    p.add_argument("--build", type=int, default=None, metavar="N",
                   help="prepare, replay: llama.cpp build N (built by `history`) instead of the pinned one")
    from fidelity.commands.llamacpp_history import add_arguments as history_arguments
    history_arguments(p.add_argument_group("history"))
    p.add_argument("--out", default=None,
                   help="kld-base: the file written (default golden.kld); replay: the folder (default reports); "
                        "history: writes <out>/llamacpp-history/ (default reports)")


def run(args) -> int:
    from fidelity.llamacpp import paths
    from fidelity.llamacpp.prepare import gguf
    from fidelity.weights.source import EMBEDDED, resolve_checkpoint
    src = Path(resolve_checkpoint(args.checkpoint)) if args.checkpoint else EMBEDDED
    if not (src / "config.json").is_file():
        raise CommandError(f"{src} is not a checkpoint folder (no config.json)", 2)
    if args.action == "kld-base":          # the golden alone (a widened copy computes the same)
        return _kld_base(args, src)
    if args.action == "history":
        from fidelity.commands.llamacpp_history import run as history
        return history(args, src)
    build = paths.of(args.build) if args.build else None
    try:
        ck, model = (src, Path(args.gguf)) if args.gguf else gguf(src, args.fp8, build)
        (build or paths.pinned()).require()
    except paths.NotBuilt as e:
        raise CommandError(str(e), 2) from None
    print(f"checkpoint {ck}\nGGUF {model}")
    if args.action == "replay":
        return _replay(args, ck, model, build)
    return 0


def _golden(ck: Path):
    from fidelity.scores.inprocess import InProcessScorer
    from fidelity.pipeline.model import arm_numerics
    from fidelity.weights.source import load_tokenizer_for, load_weights
    w, _ = load_weights(str(ck))
    return w, load_tokenizer_for(str(ck)), InProcessScorer("golden", arm_numerics("golden", "reference", {}, "v4"), w)


def _text_ids(args, tok, n: int) -> list[int]:
    return _text_and_needle(args, tok, n)[0]


def _text_and_needle(args, tok, n: int) -> tuple[list[int], tuple[int, ...]]:
    """The ids a replay runs on (a grid prompt, a text file or a haystack) and the needle
    value's token positions among them (none for a text file)."""
    from fidelity.design.prompts import grid_prompt, haystack_ids
    if getattr(args, "prompt", None):
        try:
            p = grid_prompt(tok, args.prompt, args.seed)
        except ValueError as e:
            raise CommandError(f"--prompt: {e}", 2) from None
        return p.tokens.tolist(), p.needle_tokens
    needle: tuple[int, ...] = ()
    if args.text:
        try:
            ids = tok.encode(Path(args.text).read_text())
        except OSError as e:
            raise CommandError(f"cannot read --text {args.text}: {e.strerror}", 2) from None
    else:                                         # a haystack at least as long as the template needs
        ids, needle = haystack_ids(tok, max(n, 1024), 50, 0)
    if len(ids) < n:
        raise CommandError(f"the text has {len(ids)} tokens, {n} needed", 2)
    return list(ids[:n]), tuple(p for p in needle if p < n)


def _replay(args, ck: Path, model: Path, build=None) -> int:
    from fidelity.llamacpp import replay as R
    try:
        arms = R.replay_arms(args.arm, args.cache_type)
    except ValueError as e:
        raise CommandError(str(e), 2) from None
    w, tok, _ = _golden(ck)
    ids, needle = _text_and_needle(args, tok, args.tokens)
    out = Path(args.out or "reports") / "llamacpp-replay"
    out.mkdir(parents=True, exist_ok=True)
    r = R.run(model, w, ids, arms, out, args.path, args.cache_type, build, needle_positions=needle)
    table, iso = r.table, r.iso
    searched = None
    if args.search:
        from fidelity.llamacpp.twin_search import search
        searched = search(r.engine, w, ids, args.path, table, r.taps[R.GOLDEN], R.twin_of(args.cache_type),
                          args.search, progress=lambda m: print(m, file=sys.stderr, flush=True))
    found = R.findings(table, iso, args.path, args.cache_type, searched)
    tag = f"{args.path}-{args.cache_type}"
    table.to_csv(out / f"replay-{tag}.csv", index=False)
    for block, t in iso.items():
        t.to_csv(out / f"isolated-{block.lower()}-{tag}.csv", index=False)
    (out / f"findings-{tag}.json").write_text(json.dumps(found, indent=1))
    fmt = lambda v: f"{v:.3g}"  # noqa: E731
    print(table.to_string(index=False, float_format=fmt))
    for block, t in iso.items():
        if len(t):
            print(f"\nEach layer's {block} fed llama.cpp's own inputs ({ISOLATED[block]}; relative error):")
            print(t.to_string(index=False, float_format=fmt))
    print("\n" + "\n".join(R.headline(found)))
    return exit_code(R.flagged(found))


def _kld_base(args, ck: Path) -> int:
    from fidelity.llamacpp import golden_logits as G
    from fidelity.llamacpp import logits_file as F
    w, tok, golden = _golden(ck)
    if args.compare:
        try:
            lf = F.read(args.compare)
        except OSError as e:
            raise CommandError(f"cannot read {args.compare}: {e.strerror}", 2) from None
        except F.LogitsFileError as e:
            raise CommandError(str(e), 2) from None
        if lf.n_vocab != w.cfg.vocab_size:
            raise CommandError(f"{args.compare} has a {lf.n_vocab}-token vocabulary, the checkpoint "
                               f"{w.cfg.vocab_size}: written from another model", 2)
        res = G.compare(lf, golden, tok.bos_id)
        print(json.dumps(res, indent=1))
        return 0
    tokens = G.chunk_tokens(_text_ids(args, tok, args.ctx * args.chunks), args.ctx, args.chunks)
    path = G.write_golden(args.out or "golden.kld", golden, tokens, w.cfg.vocab_size, tok.bos_id)
    print(f"wrote {path}: {args.chunks} chunks of {args.ctx} tokens, golden log-probs at positions "
          f"{args.ctx // 2}..{args.ctx - 2} of each")
    return 0
