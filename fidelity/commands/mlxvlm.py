"""`fidelity mlxvlm`: MLX's DeepSeek-V4 (mlx-vlm, the pinned release: `make mlx-vlm`) against the golden.

  serve    the harness in the foreground: mlx-vlm's model and cache behind /score and
           /v1/completions, for `fidelity kld --endpoint`, `fidelity needle --endpoint`, ...
  replay   mlx-vlm's tensors vs the golden's taps by one route, propagated and isolated
  explain  every route against its twin, each departing route replayed and probed for
           causality: where and why mlx-vlm departs, in sentences (fidelity.mlxvlm.explain)
  history  PyPI's releases with DeepSeek-V4, each installed, scored against the golden and the twin,
           adjacent releases compared, a change bisected and attributed (fidelity.mlxvlm.history)"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from fidelity.errors import CommandError

HELP = "mlx-vlm (MLX's DeepSeek-V4) against the golden: serve, tensor replay, explain"
EXAMPLES = """\
    fidelity mlxvlm serve --port 8090                   # then: fidelity kld --arm golden=golden --endpoint mlx=http://127.0.0.1:8090
    fidelity mlxvlm serve --route prefill --load f32    # the whole prompt in one call, dense float32 weights
    fidelity mlxvlm serve --index-block 0 --port 8091   # HISA off (mlx-vlm's own switch): the exact top-k
    fidelity mlxvlm replay --route decode --tokens 240  # where mlx-vlm's generation path departs, per tensor
    fidelity mlxvlm explain                             # every route vs its twin: which depart, where, why
    fidelity mlxvlm explain --patch carry-window        # ... with the candidate fix of what it found
    fidelity mlxvlm history --releases 0.6.0,0.6.4,0.7.0,0.7.10   # releases scored, compared, changes bisected
    fidelity mlxvlm history --bisect 0.7.0..0.7.10      # the first release whose numbers change between two
"""
DEFAULT_RELEASES = "spread:6"


def add_arguments(p):
    p.add_argument("action", choices=("serve", "replay", "explain", "history"))
    p.add_argument("--checkpoint", default="tiny-needle-v2",
                   help="DeepSeek-native checkpoint folder or embedded model name (default: %(default)s)")
    p.add_argument("--load", choices=("native", "f32"), default=None,
                   help="how mlx-vlm loads it: native (DeepSeek's FP8/FP4 through mlx-vlm's loader; serve's "
                        "default) or f32 (our exact dequantisation, float32: replay's and explain's default)")
    p.add_argument("--route", default="decode",
                   help="serve, replay: decode (one token per call), prefill, chunked:N, generate or nocache")
    p.add_argument("--routes", default=",".join(("prefill", "chunked:64", "decode", "nocache")),
                   help="explain: the routes compared (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=240, help="replay, explain: prompt length (default: %(default)s)")
    p.add_argument("--prompt", default=None, metavar="ID",
                   help="replay, explain: one prompt of `fidelity kld`'s grid by its id (e.g. L511-d50-r0)")
    p.add_argument("--seed", type=int, default=0, help="--prompt: the kld run's --seed (default 0)")
    p.add_argument("--port", type=int, default=8090, help="serve: port (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="serve: interface (default: %(default)s)")
    p.add_argument("--name", default="mlx-vlm", help="serve: the model id it answers to (default: %(default)s)")
    p.add_argument("--patch", action="append", default=[], choices=("carry-window",),
                   help="a candidate fix of a departure found here, applied to mlx-vlm at run time (repeatable; "
                        "carry-window: the overlapping compressor given the previous window across calls)")
    p.add_argument("--index-block", type=int, default=None, metavar="N",
                   help="serve: mlx-vlm's HISA block size instead of its config's (its own switch; 0: HISA off, "
                        "the exact top-k)")
    from fidelity.commands.engine_history import add_arguments as history_arguments
    history_arguments(p.add_argument_group("history"), "--releases", "release", "0.6.0,0.7.0,0.7.10",
                      DEFAULT_RELEASES, 0)
    p.add_argument("--out", default="reports", help="replay, explain, history: writes <out>/mlxvlm-<action>/")


def run(args) -> int:
    from fidelity.mlxvlm import convert, paths
    from fidelity.mlxvlm.harness import routes
    from fidelity.weights.source import resolve_checkpoint
    src = Path(resolve_checkpoint(args.checkpoint))
    if not (src / "config.json").is_file():
        raise CommandError(f"{src} is not a checkpoint folder (no config.json)", 2)
    for r in [args.route, *args.routes.split(",")]:
        try:
            routes(r.strip(), 2)
        except SystemExit as e:
            raise CommandError(str(e), 2) from None
    weights = args.load or ("native" if args.action == "serve" else "f32")
    if args.action == "history":
        return _history(args, src, weights)
    try:
        paths.pinned().python()
    except paths.NotInstalled as e:
        raise CommandError(str(e), 2) from None
    model = convert.model_dir(src, weights)
    if args.action == "serve":
        cmd = paths.harness_command(model, args.port, weights, args.route, args.name, args.host, patches=args.patch,
                                    index_block=args.index_block)
        sys.stdout.flush()
        os.execv(cmd[0], cmd)
    ids = _ids(args, src)
    from fidelity.weights.source import load_weights
    w, _ = load_weights(str(src), mode="dense")
    out = Path(args.out) / f"mlxvlm-{args.action}"
    if args.action == "replay":
        return _replay(model, w, ids, args.route, weights, out, args.patch)
    from fidelity.mlxvlm import explain as E
    e = E.explain(model, w, ids, weights, [r.strip() for r in args.routes.split(",")],
                  progress=lambda m: print(m, file=sys.stderr, flush=True), patches=args.patch)
    E.write(e, out)
    print("\n".join(e["sentence"]) + f"\nreport: {out}")
    return 1 if any(x["departs"] or x["causality"]["first_moved"] is not None for x in e["routes"]) else 0


def _ids(args, src: Path) -> list[int]:
    from fidelity.design.prompts import grid_prompt, haystack_ids
    from fidelity.weights.source import load_tokenizer_for
    tok = load_tokenizer_for(str(src))
    if args.prompt:
        try:
            return grid_prompt(tok, args.prompt, args.seed).tokens.tolist()
        except ValueError as e:
            raise CommandError(f"--prompt: {e}", 2) from None
    if args.tokens < 2:
        raise CommandError("--tokens must be at least 2", 2)
    ids, _ = haystack_ids(tok, max(args.tokens, 1024), 50, args.seed)        # long enough for any template
    return list(ids[:args.tokens])


def _replay(model: Path, w, ids: list[int], route: str, weights: str, out: Path, patches=()) -> int:
    from fidelity.mlxvlm import replay as X
    r = X.run(model, w, ids, route, weights, patches=patches)
    f = X.findings(r, route, weights)
    out.mkdir(parents=True, exist_ok=True)
    tag = route.replace(":", "")
    r.table.to_csv(out / f"replay-{tag}.csv", index=False)
    r.compressors.to_csv(out / f"compressors-{tag}.csv", index=False)
    (out / f"findings-{tag}.json").write_text(json.dumps(f, indent=1, default=str))
    fmt = lambda v: f"{v:.3g}"  # noqa: E731
    print(r.table.to_string(index=False, float_format=fmt))
    print("\nEach compressor fed mlx-vlm's own attention input (entries that depart from every modelled arm):")
    print(r.compressors.to_string(index=False, float_format=fmt))
    for block, t in r.iso.items():
        if len(t):
            print(f"\nEach layer's {block} fed mlx-vlm's own inputs (relative error):")
            print(t.to_string(index=False, float_format=fmt))
    print("\n" + "\n".join(X.headline(f)))
    return 1 if f["compressors"] or f["block"] or f["unexplained"] else 0


def _release(text: str) -> str:
    from fidelity.mlxvlm.history import FIRST, version_key
    v = text.lstrip("v")
    if not re.fullmatch(r"\d+(\.\d+)+", v):
        raise ValueError(f"give mlx-vlm releases such as 0.6.0,0.7.10 or spread:6 ({text!r} is not one)")
    if version_key(v) < version_key(FIRST):
        raise ValueError(f"mlx-vlm {v} predates DeepSeek-V4 in mlx-vlm (first: {FIRST})")
    return v


def _history(args, src: Path, weights: str) -> int:
    from fidelity.commands import engine_history as E
    from fidelity.history import report as R
    from fidelity.mlxvlm import convert
    from fidelity.mlxvlm import history as H
    available = E.listed_once(H.available, H.ReleasesError)

    bis = E.parse_bisect(args.bisect, _release, lambda a, b: H.version_key(a) < H.version_key(b), "0.7.0..0.7.10",
                         "release")
    keys = E.parse_keys(args.releases or (None if bis else DEFAULT_RELEASES), available, _release, "--releases",
                        "release")
    try:
        longest = max(int(x) for x in args.lengths.split(","))
    except ValueError:
        raise CommandError(f"--lengths {args.lengths}: the history takes token counts, e.g. 256,511", 2) from None
    hisa = convert.HISA_DEFAULTS
    if longest // 4 > hisa["index_block"] * hisa["index_keep"]:      # one twin for every release only without HISA
        raise CommandError(f"--lengths {args.lengths}: past {4 * hisa['index_block'] * hisa['index_keep']} tokens "
                           "mlx-vlm's HISA engages from 0.6.4 on and releases would need different twins; measure "
                           "long contexts with --needle-length", 2)
    s = H.Settings(src, lengths=args.lengths, reps=args.reps, needle_length=args.needle_length, weights=weights,
                   route=args.route, threads=args.threads or 1)
    h = H.History(Path(args.out) / "mlxvlm-history", s, progress=lambda m: print(m, file=sys.stderr, flush=True))
    if bis:          # a bisection walks PyPI's list: both ends must be on it
        missing = [v for v in bis if v not in available()]
        if missing:
            raise CommandError(f"--bisect: mlx-vlm {missing[0]} is not on PyPI's list ({', '.join(available())})", 2)

    def loads():                     # where mlx-vlm's own loader stops loading DeepSeek's checkpoint
        for a, b in h.load_changes(h.asked()):          # over every run's releases, as the timeline
            r = h.bisect_load(available(), a, b)
            if r["adjacent"]:
                h.cause(*r["change"])
            yield r["sentence"]
    return E.run(h, R, h.order(keys), bis, available, args.no_bisect, more=loads)
