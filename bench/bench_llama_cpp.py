"""llama.cpp b11434 (the first engine the toolkit did not write) against the golden, measured
here: every GGUF variant served by llama-server and scored by the toolkit's own commands.

Variants: F32 GGUF (FP8 weights dequantised exactly), F32 with a q8_0 KV cache, Q8_0 (what
llama.cpp's converter writes) as served by default and with --no-repack, Q4_K_M (llama-quantize
from F32, experts kept MXFP4) with --no-repack. Per variant:
  kld      `fidelity kld`, golden + floors in-process vs llama-server (teacher-forced, decode path)
  prefill  llama-perplexity's own logits file scored against the golden (its prefill path)
  needle   `fidelity needle` recall vs context, golden in-process vs llama-server
  replay   `fidelity llamacpp replay`'s first departure (prefill; F32)
  paths    the same text through both paths, against golden, exact and each other (F32)
and once (F32, -np 4): `fidelity chat-check` and `fidelity consistency`.
Writes bench/results/llama_cpp.json and docs/real-engines.md's measured tables (`--render`:
the tables again from the stored JSON).
Needs `make llama-cpp`. Takes ~20-30 minutes on 2 cores (more with the 8K and 16K needles); `--once` runs only chat-check and
consistency again (the stored variants kept); `--kld` only `fidelity kld` on every variant (the
rest kept)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fidelity.llamacpp import flags as LF  # noqa: E402
from fidelity.llamacpp import paths  # noqa: E402
from fidelity.llamacpp import variants_report as VR  # noqa: E402
from fidelity.llamacpp.prepare import gguf  # noqa: E402
from fidelity.llamacpp.server import ServerFailed, serving  # noqa: E402
from engine_bench import fidelity, kld_row  # noqa: E402

MODEL = ROOT / "models" / "tiny-needle-v2"
OUT = Path("/tmp/bench-llama")
RESULTS = ROOT / "bench" / "results" / "llama_cpp.json"
KLD_LENGTHS, KLD_REPS = "256,511,1023", 2
NEEDLE_LENGTHS, NEEDLE_REPS = "512,1024,2048,4096,8192,16384", 3
CTX = 16384 + 1024                                  # the longest needle prompt and its answer


def q4_k_m(f32: Path) -> Path:
    """Q4_K_M from the F32 GGUF, routed experts kept MXFP4 (exact: llama-quantize refuses to
    requantize them, and a user would keep the checkpoint's own FP4); tensors whose rows are
    not a multiple of 256 fall back to q5_0, as llama-quantize decides."""
    out = f32.with_name(f32.name.replace("-f32-", "-q4_k_m-"))
    if not out.is_file():
        tmp = out.with_name(out.name + ".part")          # a failed run leaves no file under the name
        subprocess.run([str(paths.program("llama-quantize")), "--tensor-type", "exps=mxfp4", str(f32),
                        str(tmp), "Q4_K_M"], check=True, capture_output=True)
        tmp.replace(out)
    return out


def twin(extra: tuple) -> str:
    """llama.cpp's in-process twin under these flags, read as its scores are (fidelity.llamacpp.flags)."""
    return LF.scored_twin(list(extra))


def kld(name: str, url: str, ck: Path, extra: tuple = ()) -> dict:
    """One run folder per variant (the golden's and floors' scores stored once and reused),
    judged twice by kld itself: against the golden, and against llama.cpp's in-process twin
    under these flags (`--twin`, read as its scores are: fidelity.llamacpp.flags) in
    <run>-vs-<twin> -- what the twin leaves unexplained leads."""
    run_id = f"kld-{name}"
    arm = f"llama-{name}"
    fidelity("kld", "--arm", "golden=golden", "--endpoint", f"{arm}={url}", "--checkpoint", str(ck),
             "--twin", f"{arm}={twin(extra)}",
             "--lengths", KLD_LENGTHS, "--reps", str(KLD_REPS), "--decode-steps", "4", "--top-k", "512",
             "--no-captures", "--out", str(OUT), "--quiet", "--run-id", run_id)
    return kld_row(OUT, run_id, arm)


def prefill(name: str, model: Path, ck: Path, extra: tuple = ()) -> dict:
    text = OUT / "text.txt"
    text.write_text(("The river runs past the old mill, and the miller counts 1234 sacks of grain "
                     "while the clock in the square strikes nine. ") * 120)
    base = OUT / f"{name}.kld"
    subprocess.run([str(paths.program("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", "512",
                    "-b", "512", "--chunks", "4", "-t", "1", *extra, "--kl-divergence-base", str(base)],
                   check=True, capture_output=True)
    r = fidelity("llamacpp", "kld-base", "--checkpoint", str(ck), "--compare", str(base))
    res = json.loads(r.stdout[r.stdout.index("{"):])
    return {k: res[k] for k in ("kld_mean", "kld_p99", "kld_max", "same_top1", "dp_rms", "positions")}


def two_paths(name: str, url: str, ck: Path) -> dict:
    """The same 4 x 512 tokens through llama.cpp's two paths -- the server's decode path
    (teacher-forced) and llama-perplexity's prefill (its logits file, written by prefill()
    first) -- each scored against the golden and the exact profile, and against each other."""
    import numpy as np
    from fidelity.scores.dialects import Request
    from fidelity.kld.endpoint import Endpoint
    from fidelity.scores.inprocess import InProcessScorer
    from fidelity.llamacpp import golden_logits as G
    from fidelity.llamacpp import logits_file as F
    from fidelity.pipeline.model import arm_numerics
    from fidelity.weights.source import load_tokenizer_for, load_weights
    from reference_model.numerics import Numerics
    w, _ = load_weights(str(ck))
    tok = load_tokenizer_for(str(ck))
    lf = F.read(OUT / f"{name}.kld")
    ep = Endpoint("llama", url, tokenizer=tok).connect()
    refs = {"golden": InProcessScorer("golden", arm_numerics("golden", "reference", {}, "v4"), w),
            "exact": InProcessScorer("exact", Numerics("exact"), w)}
    kl = {k: [] for k in ("decode vs golden", "prefill vs golden", "decode vs exact", "prefill vs exact",
                          "prefill vs decode")}
    first = F.first_scored(lf.n_ctx)
    for c in range(lf.n_chunk):
        s = ep.score(G.evaluated(lf.tokens[c], tok.bos_id), Request(k=lf.n_vocab, steps=1))
        dec = []
        for k in s.known[first:lf.n_ctx - 1]:
            row = np.full(lf.n_vocab, -1e30)
            row[k.ids] = k.logp
            dec.append(row)
        pre = list(lf.rows(c))
        for ref, sc in refs.items():
            g = list(G.GoldenRows(sc, lf.tokens, tok.bos_id)(c))
            kl[f"decode vs {ref}"] += [G.kld_rows(a, b) for a, b in zip(g, dec)]
            kl[f"prefill vs {ref}"] += [G.kld_rows(a, b) for a, b in zip(g, pre)]
        kl["prefill vs decode"] += [G.kld_rows(a, b) for a, b in zip(dec, pre)]
    return {k: {"mean": float(np.mean(v)), "p99": float(np.percentile(v, 99)), "max": float(np.max(v))}
            for k, v in kl.items()}


def needle(name: str, url: str, ck: Path) -> dict:
    """One sweep: each variant's arm is added to the stored results (the golden's trials run once)."""
    fidelity("needle", "--arm", "golden=golden", "--endpoint", f"llama-{name}={url}", "--checkpoint", str(ck),
             "--lengths", NEEDLE_LENGTHS, "--depths", "10,50,90", "--reps", str(NEEDLE_REPS),
             "--out", str(OUT), "--run-id", "needle", "--quiet", "--no-plots")
    s = json.loads((OUT / "needle" / "needle" / "summary.json").read_text())["tables"]
    cells = pd.DataFrame(s["cells"])
    by_len = cells.groupby(["arm", "length"]).apply(lambda g: g.correct.sum() / max(g.n_scored.sum(), 1))
    return {"recall": {a["arm"]: [a["recall"], a["ci_low"], a["ci_high"]] for a in s["arms"]},
            "by_length": {f"{a}@{n}": float(v) for (a, n), v in by_len.items()}}


def replay(model: Path, ck: Path, cache_type: str = "f16") -> str:
    r = fidelity("llamacpp", "replay", "--checkpoint", str(ck), "--gguf", str(model), "--tokens", "240",
                 "--cache-type", cache_type, "--out", str(OUT))
    return next(ln for ln in r.stdout.splitlines() if ln.startswith("llama.cpp ("))


def once(url: str, ck: Path) -> dict:
    cc = fidelity("chat-check", "--endpoint", url, "--generation", "original", "--tokenizer",
                  str(ck / "tokenizer.json"), "--out", str(OUT), "--run-id", "chat", "--quiet")
    cases = pd.read_csv(OUT / "chat-check" / "chat" / "cases.csv")
    cons = fidelity("consistency", "--endpoint", f"llama={url}", "--arm", "golden=golden",
                    "--checkpoint", str(ck), "--chunk-size", "512", "--out", str(OUT), "--run-id", "cons",
                    "--fresh")
    return {"chat_check": cases.status.value_counts().to_dict(), "chat_check_line": cc.stdout.strip().splitlines()[-2],
            "consistency": [ln for ln in (cons.stdout + cons.stderr).splitlines() if ln.startswith("`")]}


def main() -> int:
    paths.require()
    OUT.mkdir(parents=True, exist_ok=True)          # stored scores and trials are reused (resume)
    if "--once" in sys.argv:                        # only chat-check and consistency again
        return rerun_once()
    if "--kld" in sys.argv:                         # only the kld scoring again (e.g. a new twin)
        rest = sys.argv[sys.argv.index("--kld") + 1:]  # optionally: the variants, comma-separated
        return rerun_kld(rest[0].split(",") if rest else None)
    ck, f32, variants = _variants()
    res = {"build": paths.PINNED, "model": f"{MODEL.name} widened to head_dim 512", "variants": {}}
    for port, (name, model, extra) in enumerate(variants, 18700):   # fixed ports: a rerun resumes
        t0 = time.time()
        key = VR.key(name)
        try:
            with serving(model, OUT / f"{key}.log", ctx=CTX, extra=extra, port=port) as url:
                row = {"kld": kld(key, url, ck, extra), "needle": needle(key, url, ck)}
        except ServerFailed as e:                    # a finding, not a crash of the bench
            first = next((ln for ln in str(e).splitlines() if "GGML_ASSERT" in ln or "error" in ln.lower()), str(e)[:200])
            res["variants"][name] = {"failed": first.split("/src/")[-1].split(" (log:")[0].strip()}
            print(name, "failed:", res["variants"][name]["failed"], flush=True)
            continue
        row["prefill"] = prefill(key, model, ck, extra)
        if model == f32:
            row["replay"] = replay(model, ck, LF.read(list(extra)).cache_type)
            if name == "F32":
                with serving(model, OUT / f"{key}-paths.log", ctx=CTX, port=port) as url:
                    row["two_paths"] = two_paths(key, url, ck)
        row["seconds"] = round(time.time() - t0)
        res["variants"][name] = row
        print(name, json.dumps(row)[:400], flush=True)
    return finish(res, f32, ck)


def _variants():
    """(checkpoint, the F32 GGUF, [(name, GGUF, llama-server flags)]) of every variant.
    Quantized weights need --no-repack on this CPU (AMX): with repacking llama-server aborts
    (Q8_0 wo_a: no backend for its node) or crashes in ggml_backend_amx_mul_mat."""
    ck, f32 = gguf(MODEL, "f32")
    _, q8 = gguf(MODEL, "q8_0")
    q4 = q4_k_m(f32)
    return ck, f32, [("F32", f32, ()), ("F32 + KV q8_0", f32, ("-ctk", "q8_0", "-ctv", "q8_0")),
                     ("Q8_0", q8, ()), ("Q8_0 --no-repack", q8, ("--no-repack",)),
                     ("Q4_K_M --no-repack", q4, ("--no-repack",))]


def rerun_kld(only: list[str] | None = None) -> int:
    """`fidelity kld` again on every variant that served, or on `only` (its stored golden and
    floor scores reused; a new twin scored), the other measurements kept; results and doc
    rewritten."""
    res = json.loads(RESULTS.read_text())
    ck, _, variants = _variants()
    for port, (name, model, extra) in enumerate(variants, 18700):
        row = res["variants"].get(name)
        if row is None or "failed" in row or (only and name not in only):
            continue
        with serving(model, OUT / f"{VR.key(name)}.log", ctx=CTX, extra=extra, port=port) as url:
            row["kld"] = kld(VR.key(name), url, ck, extra)
        RESULTS.write_text(json.dumps(res, indent=1, default=float))
        print(name, json.dumps(row["kld"])[:300], flush=True)
    write_doc(res)
    return 0


def rerun_once() -> int:
    """chat-check and consistency again (F32, -np 4), the stored variants kept."""
    ck, f32 = gguf(MODEL, "f32")
    return finish(json.loads(RESULTS.read_text()), f32, ck)


def finish(res: dict, f32: Path, ck: Path) -> int:
    """chat-check and consistency once (F32, -np 4), then the results and the doc written."""
    with serving(f32, OUT / "once.log", ctx=CTX, slots=4, port=18799) as url:
        res["once"] = once(url, ck)
    RESULTS.write_text(json.dumps(res, indent=1, default=float))
    write_doc(res)
    print(f"wrote {RESULTS} and {DOC}")
    return 0


def _table(head: list[str], rows: list[list]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def render(res: dict) -> str:
    """The measured section of docs/real-engines.md, from the results JSON."""
    failed = {n: r["failed"] for n, r in res["variants"].items() if "failed" in r}
    v = {n: r for n, r in res["variants"].items() if "failed" not in r}
    out = [f"`bench/bench_llama_cpp.py` on this machine (2 cores), {res['build']}, model {res['model']}; "
           f"raw numbers in `bench/results/llama_cpp.json`.", "",
           "**Next-token KLD, decode path** (`fidelity kld`, teacher-forced through llama-server; "
           f"lengths {KLD_LENGTHS}, {KLD_REPS} reps x 3 depths; KL exact: top-512 of a 512 vocabulary; "
           "floor = the highest in-process floor's upper 95% bound):", "",
           _table(["GGUF", "positions", "mean KLD [95% CI]", "floor", "p99", "max", "same top-1"],
                  [[n, r["kld"]["positions"], f"{r['kld']['kld_mean']:.3g} [{r['kld']['kld_lo']:.3g}, {r['kld']['kld_hi']:.3g}]",
                    f"{r['kld']['floor_kld_hi']:.3g}", f"{r['kld']['kld_p99']:.3g}", f"{r['kld']['kld_max']:.3g}",
                    f"{r['kld']['same_top1']:.4f}"] for n, r in v.items()]), "",
           "Verdicts: " + " ".join(f"*{n}*: {r['kld']['verdict']}" for n, r in v.items()), "",
           "**Against llama.cpp's in-process twin** (the same prompts, kld's second judgement: the exact "
           "profile with the toggles its flags map to, `fidelity.llamacpp.flags`; mean KLD; the twin's "
           "own distance from the golden is the by-design gap):", "",
           _table(["GGUF", "twin", "llama.cpp vs twin", "twin vs golden", "verdict vs twin"],
                  [[n, f"`{r['kld']['twin']}`", f"{r['kld']['vs_twin']:.3g}",
                    _num(r["kld"].get("golden_vs_twin")), r["kld"].get("twin_verdict", "-")]
                   for n, r in v.items() if "vs_twin" in r["kld"]]), "",
           "**Next-token KLD, prefill path** (llama-perplexity's own logits file, 4 chunks of 512, "
           "scored against the golden by `fidelity llamacpp kld-base --compare`):", "",
           _table(["GGUF", "positions", "mean KLD", "p99", "max", "same top-1", "RMS dp"],
                  [[n, r["prefill"]["positions"], f"{r['prefill']['kld_mean']:.3g}", f"{r['prefill']['kld_p99']:.3g}",
                    f"{r['prefill']['kld_max']:.3g}", f"{r['prefill']['same_top1']:.4f}", f"{r['prefill']['dp_rms']:.3g}"]
                   for n, r in v.items() if "prefill" in r]), "",
           "**The two paths on the same text** (F32; the prefill table's 4 x 512 tokens, positions "
           "256-510 of each chunk, also read through llama-server's decode path; mean / p99 / max KLD):", "",
           _table(["pair", "mean", "p99", "max"],
                  [[k, f"{x['mean']:.3g}", f"{x['p99']:.3g}", f"{x['max']:.3g}"]
                   for k, x in v.get("F32", {}).get("two_paths", {}).items()]), "",
           f"**Needle recall vs context** (`fidelity needle`, chat API, single needle, depths 10/50/90, "
           f"{NEEDLE_REPS} reps; recall per length, then overall with its 95% interval):", ""]
    last = list(v.values())[-1]["needle"]
    lengths = [int(x) for x in NEEDLE_LENGTHS.split(",")]
    arms = sorted(last["recall"], key=lambda a: (a != "golden", a))
    out += [_table(["arm"] + [str(n) for n in lengths] + ["overall"],
                   [[a] + [f"{last['by_length'].get(f'{a}@{n}', float('nan')):.2f}" for n in lengths]
                    + ["{:.2f} [{:.2f}, {:.2f}]".format(*last["recall"][a])] for a in arms]), "",
            "**Tensor replay** (`fidelity llamacpp replay`, 240 tokens, prefill, the variant's cache type):", ""]
    out += [f"- {n}: {r['replay']}" for n, r in v.items() if "replay" in r]
    if failed:
        out += ["", "**Variants llama-server could not start:**", ""]
        out += [f"- {n}: `{why}`" for n, why in failed.items()]
    once = res.get("once", {})
    if once:
        counts = ", ".join(f"{n} {k}" for k, n in once["chat_check"].items())
        out += ["", f"**chat-check** (`--generation original`, cases by outcome): {counts}.", "",
                "**consistency** (F32, `-np 4`, `--chunk-size 512`), its closing lines:", "", "```"]
        out += once["consistency"] + ["```"]
    return "\n".join(out)


def _num(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def variants_table(res: dict) -> str:
    """The doc's opening table: one row per GGUF variant (variants_report.variants_frame,
    the same rows the variants page shows)."""
    t = VR.variants_frame(res, NEEDLE_LENGTHS.split(",")[-1])
    g = next((r["needle"]["recall"].get("golden") for r in reversed(res["variants"].values()) if "needle" in r), None)
    return "\n".join([
        f"Every GGUF variant of tiny-needle-v2 ({res['build']}) served by llama-server and measured by "
        "`bench/bench_llama_cpp.py` on this machine; details under *Measured* below, the same table as a "
        "[report page](../reports/llamacpp-variants/index.html). KLD: decode path, "
        f"{KLD_LENGTHS} tokens, mean [95% CI] against the highest in-process floor's upper bound "
        "(the point estimate over that bound in brackets). Needle: recall over "
        f"{NEEDLE_LENGTHS} tokens [95% CI]" + (f" (golden {g[0]:.2f} [{g[1]:.2f}, {g[2]:.2f}])" if g else "")
        + ", and at the longest. " + VR.TWIN_NOTE, "", VR.headline(res), "",
        _table(list(t.columns), t.values.tolist())])


DOC = ROOT / "docs" / "real-engines.md"


def _between(text: str, tag: str, body: str) -> str:
    a, b = text.index(f"<!-- {tag}:start -->"), text.index(f"<!-- {tag}:end -->")
    return text[:a] + f"<!-- {tag}:start -->\n" + body + "\n" + text[b:]


def write_doc(res: dict) -> None:
    """docs/real-engines.md's two generated parts and the variants page (reports/llamacpp-variants)."""
    DOC.write_text(_between(_between(DOC.read_text(), "measured", render(res)), "variants", variants_table(res)))
    VR.write(res, ROOT / "reports", KLD_LENGTHS, NEEDLE_LENGTHS)


if __name__ == "__main__":
    if sys.argv[1:] == ["--render"]:                 # the doc again from the stored results
        write_doc(json.loads(RESULTS.read_text()))
        sys.exit(0)
    sys.exit(main())
