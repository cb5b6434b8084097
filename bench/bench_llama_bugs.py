"""Planted bugs in a private copy of llama.cpp b11434 (the pinned PyPI source, `make
llama-cpp`): one-line edits of its DeepSeek-V4 graph (src/models/deepseek4.cpp) spread over
its parts, some smaller than llama.cpp's by-design gap to the golden, and a null refactor.
Each variant is built (only the edited file recompiles), served by its own llama-server and
run through the documented workflow:

  kld     `fidelity kld --arm golden=golden --endpoint NAME=URL` (decode path,
          teacher-forced): the golden judgement and the twin judgement it now makes
  replay  `fidelity llamacpp replay` (prefill): the isolated blocks and the headline

The edits live only in .llama/bugs/ (git-ignored) and never reach the repository; the
clean variant is the same private tree unedited. Results append to
bench/results/llama_bugs.json (a rerun resumes; `--fresh VARIANT` measures one again) and
render into docs/real-engines.md between its `bugs:` markers (`--render`: only that;
`--replay`: the replay again on every variant measured; `--headlines`: each replay headline
again from its findings file).
Takes about 5 minutes per variant on 2 cores after a first build of about 8."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fidelity.llamacpp import paths  # noqa: E402
from fidelity.llamacpp import replay as R  # noqa: E402
from fidelity.llamacpp.prepare import gguf  # noqa: E402
from fidelity.llamacpp.server import serving  # noqa: E402

MODEL = ROOT / "models" / "tiny-needle-v2"
WORK = paths.home() / "bugs"                       # the private tree, its build and one folder per variant
OUT = Path("/tmp/bench-llama-bugs")
RESULTS = ROOT / "bench" / "results" / "llama_bugs.json"
DOC = ROOT / "docs" / "real-engines.md"
GRAPH = "src/models/deepseek4.cpp"
KLD_ARGS = ("--lengths", "256,511,1023", "--depths", "10,50,90", "--decode-steps", "4", "--top-k", "512", "--no-captures")


@dataclass(frozen=True)
class Bug:
    name: str
    part: str          # where in the graph
    what: str          # the edit in words
    old: str           # text that occurs once in deepseek4.cpp
    new: str


BUGS = [
    Bug("clean", "-", "no edit", "", ""),
    Bug("null_refactor", "mHC", "2.0f spelled 1.0f + 1.0f (same value)",
        "*post = ggml_scale(ctx0, *post, 2.0f);", "*post = ggml_scale(ctx0, *post, 1.0f + 1.0f);"),
    Bug("q_norm_eps", "attention (q)", "the per-head q RMS-norm epsilon 1000x",
        "q = ggml_rms_norm(ctx0, q, norm_rms_eps);", "q = ggml_rms_norm(ctx0, q, norm_rms_eps * 1000);"),
    Bug("yarn_on_window_layers", "RoPE", "YaRN's ext_factor also on the window-only layers",
        "const float ext_factor_l     = use_compress_rope ? ext_factor : 0.0f;",
        "const float ext_factor_l     = ext_factor;"),
    Bug("hca_kq_scale", "attention (HCA)", "the HCA layers' softmax scale from n_embd_head - 8",
        "layer.attn_sinks,\n                1.0f/sqrtf(float(n_embd_head)), il);\n    } else {",
        "layer.attn_sinks,\n                1.0f/sqrtf(float(n_embd_head - 8)), il);\n    } else {"),
    Bug("indexer_q_rope_base", "indexer", "the indexer query's RoPE base doubled",
        "rope_type, n_ctx_orig, hparams.dsv4_compress_rope_base, freq_scale,",
        "rope_type, n_ctx_orig, hparams.dsv4_compress_rope_base * 2, freq_scale,"),
    Bug("index_key_bf16", "indexer", "the lightning indexer's keys rounded to bf16 before scoring (a lower-precision key store)",
        "    cb(indexer_k, \"lid_k\", il);\n\n    const int64_t n_stream",
        "    indexer_k = ggml_cast(ctx0, ggml_cast(ctx0, indexer_k, GGML_TYPE_BF16), indexer_k->type);\n"
        "    cb(indexer_k, \"lid_k\", il);\n\n    const int64_t n_stream"),
    Bug("index_fewer_picks", "indexer", "the indexer keeps half its top-k",
        "? indexer_score->ne[0] : hparams.indexer_top_k;", "? indexer_score->ne[0] : hparams.indexer_top_k / 2;"),
    Bug("mhc_post_scale", "mHC", "hc_post's 2 sigmoid scale 2.01",
        "*post = ggml_scale(ctx0, *post, 2.0f);", "*post = ggml_scale(ctx0, *post, 2.01f);"),
    Bug("routed_scaling", "MoE (routed)", "the routed scaling factor 2% high",
        "                hparams.expert_weights_scale,\n                (llama_expert_gating_func_type) hparams.expert_gating_func,\n                il,",
        "                hparams.expert_weights_scale * 1.02f,\n                (llama_expert_gating_func_type) hparams.expert_gating_func,\n                il,"),
    Bug("shared_expert_gelu", "MoE (shared)", "the shared expert's activation GELU instead of SiLU",
        "nullptr, LLM_FFN_SILU, LLM_FFN_PAR, il);\n        cb(ffn_shexp, \"ffn_shexp\", il);",
        "nullptr, LLM_FFN_GELU, LLM_FFN_PAR, il);\n        cb(ffn_shexp, \"ffn_shexp\", il);"),
]


def run(cmd, ok=(0,), **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode not in ok:
        raise RuntimeError(f"{' '.join(map(str, cmd[:3]))} failed ({r.returncode}): {(r.stdout + r.stderr)[-2000:]}")
    return r


def private_tree() -> tuple[Path, str]:
    """The private copy of the pinned source, configured as scripts/build_llama_cpp.sh does,
    and the graph file's pristine text."""
    src, build = WORK / "src", WORK / "build"
    if not (src / GRAPH).is_file():
        shutil.copytree(paths.source(), src, symlinks=True)
    pristine = WORK / "deepseek4.cpp.orig"
    if not pristine.is_file():
        shutil.copy(src / GRAPH, pristine)
    if not (build / "CMakeCache.txt").is_file():
        n = paths.PINNED.split("==")[1].split(".")[0]
        run(["cmake", "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
             f"-DLLAMA_BUILD_NUMBER={n}", f"-DLLAMA_BUILD_COMMIT=private-bugs-{n}", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF"],
            env={**os.environ, "GIT_CEILING_DIRECTORIES": str(WORK)})
    return src, pristine.read_text()


def build_variant(bug: Bug, src: Path, pristine: str) -> Path:
    """Edit, build llama-server and the tensor dumper, restore; the variant's folder is a
    build home (paths.home) of its own."""
    home = WORK / bug.name
    if (home / "bin" / "llama-fidelity-dump").is_file():
        return home
    if bug.old and pristine.count(bug.old) != 1:
        raise RuntimeError(f"{bug.name}: the text to edit occurs {pristine.count(bug.old)} times in {GRAPH}")
    (src / GRAPH).write_text(pristine.replace(bug.old, bug.new) if bug.old else pristine)
    try:
        build = WORK / "build"
        run(["cmake", "--build", build, "-j", str(os.cpu_count() or 2), "--target", "llama-server"])
        (home / "bin").mkdir(parents=True, exist_ok=True)
        shutil.copy(build / "bin" / "llama-server", home / "bin")
        libs = [build / "src" / "libllama.a", *(build / "ggml" / "src" / f"libggml{s}.a" for s in ("", "-cpu", "-base"))]
        # the dumper as scripts/build_llama_cpp.sh links it, against this variant's libraries
        run([os.environ.get("CXX", "g++"), "-O2", "-std=c++17", "-fopenmp", f"-I{src / 'include'}",
             f"-I{src / 'ggml' / 'include'}", ROOT / "fidelity" / "llamacpp" / "tensor_dump.cpp",
             "-o", home / "bin" / "llama-fidelity-dump", *libs, "-lpthread", "-ldl"])
    finally:
        (src / GRAPH).write_text(pristine)
    (home / "BUILD").write_text(paths.PINNED + "\n")
    if not (home / "src").exists():
        (home / "src").symlink_to(src)
    return home


def fidelity(home: Path, *args) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "fidelity.cli", *args, "--threads", "1"], (0, 1), cwd=ROOT,   # 1: flagged
               env={**os.environ, "LLAMA_CPP_HOME": str(home)})


def measure(bug: Bug, home: Path, ck: Path, model: Path, port: int) -> dict:
    t0 = time.time()
    os.environ["LLAMA_CPP_HOME"] = str(home)              # serving() launches this variant's llama-server
    with serving(model, OUT / f"{bug.name}.log", ctx=4096, port=port) as url:
        fidelity(home, "kld", "--arm", "golden=golden", "--endpoint", f"{bug.name}={url}",
                 "--checkpoint", str(ck), *KLD_ARGS, "--out", str(OUT), "--run-id", bug.name, "--fresh", "--quiet")
    m = json.loads((OUT / "kld" / bug.name / "manifest.json").read_text())
    v = m["verdict"]
    (tw,) = v["twins"]
    twin = json.loads((OUT / "kld" / tw["report"] / "manifest.json").read_text())
    sg = _summary(OUT / "kld" / bug.name)
    st = _summary(OUT / "kld" / tw["report"])
    return {"part": bug.part, "what": bug.what,
            "vs_golden": {"kld_mean": sg.get((bug.name, "kld_mean")), "kld_p99": sg.get((bug.name, "kld_p99")),
                          "named": [n["toggle"] for n in v.get("named", [])]},
            "vs_twin": {"kld_mean": st.get((bug.name, "kld_mean")), "kld_p99": st.get((bug.name, "kld_p99")),
                        "nonfinite": st.get((bug.name, "nonfinite")),
                        "unexplained": tw["unexplained"], "sentence": tw["sentence"],
                        "floors": twin["floors"]},
            "replay": replay(bug, home, ck, model), "seconds": round(time.time() - t0)}


def replay(bug: Bug, home: Path, ck: Path, model: Path) -> dict:
    """`fidelity llamacpp replay` on the variant: its findings and headline."""
    fidelity(home, "llamacpp", "replay", "--checkpoint", str(ck), "--gguf", str(model), "--tokens", "240",
             "--search", "--out", str(OUT / bug.name))
    found = json.loads((OUT / bug.name / "llamacpp-replay" / "findings-prefill-f16.json").read_text())
    head = R.headline(found)                     # what the command printed last, from its findings
    return {"block": found["block"], "blocks": found["blocks"], "errors": found.get("errors", {}),
            "picks": found["picks"], "propagated": found["unexplained"], "headline": head,
            "search": {k: v for k, v in (found.get("search") or {}).items() if k != "tried"}}


def _summary(report: Path) -> dict:
    import pandas as pd
    s = pd.read_csv(report / "signal_summary.csv")
    s = s[s["where"] == "final logits"]
    return {(r.arm, r.signal): float(r["mean"]) for _, r in s.iterrows()}


def beyond(r: dict, clean: dict | None) -> dict[str, list[int]]:
    """Block -> layers where the variant, fed llama.cpp's own inputs, is more than 10x
    further from every modelled arm than the clean build is (and than the twin's floor)."""
    out: dict[str, list[int]] = {}
    base = {(b, e["layer"]): e["error"] for b, es in (clean or {}).get("replay", {}).get("errors", {}).items()
            for e in es}
    for block, es in r["replay"].get("errors", {}).items():
        for e in es:
            ref = max(base.get((block, e["layer"]), 0.0), e["floor"], 1e-6)
            if e["error"] > 10 * ref:
                out.setdefault(block, []).append(e["layer"])
    return out


def _first(r: dict) -> str:
    b = r["replay"]["block"]
    return f"layer {b['layer']} {b['block']}" if b else "none"


def _searched(r: dict) -> str:
    s = r["replay"].get("search") or {}
    if not s.get("from"):
        return "-"
    if not s["added"]:
        return "none"
    return " + ".join(s["added"]) + (" (reproduces it)" if s["to"] is None else
                                     f" (to layer {s['to']['layer']} {s['to']['tensor']})")


def _flips(r: dict) -> str:
    """Rows whose picks differ from the twin's, and of those the ones beyond the scores' floor
    (fidelity.llamacpp.selection; '?' for a replay measured before it judged ties)."""
    picks = r["replay"]["picks"]
    differ = sum(p["differ"] for p in picks)
    if not all("beyond" in p for p in picks):
        return f"{differ} (ties not judged)"
    fewer = next((f"; keeps {p['engine_k']} of {p['k']}" for p in picks if p["engine_k"] < p["k"]), "")
    return f"{differ}, {sum(p['beyond'] for p in picks)} beyond the floor{fewer}"


def render(res: dict) -> str:
    """The variants' table: KLD against the golden and against the twin (each with the
    verdict's call, the twin's p99 also as a multiple of the clean build's), and what the
    replay places beyond what the clean build already departs at."""
    v = res["variants"]
    clean = v.get("clean")
    base_p99 = clean["vs_twin"]["kld_p99"] if clean else None
    rows = ["| variant | part (the edit) | vs golden: mean / p99 KLD, named? | vs twin: mean / p99 KLD, "
            "unexplained? | p99 vs twin / clean's | replay headline: first block that departs from the twin | "
            "replay: blocks fed llama.cpp's own inputs that depart (the clean build: from the twin; a variant: "
            "10x beyond the clean build) | twin search: toggle added to the twin that reproduces the propagated "
            "departure | indexer picks: rows differing from the twin's, beyond the scores' floor |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in v.items():
        g, t = r["vs_golden"], r["vs_twin"]
        nf = f", non-finite on {t['nonfinite']:.0%} of positions" if t.get("nonfinite") else ""
        by = beyond(r, clean if name != "clean" else None)
        where = "; ".join(f"{b} at layer{'s' if len(ls) > 1 else ''} {', '.join(map(str, ls))}"
                          for b, ls in by.items()) or "none"
        finite = t["kld_p99"] is not None and t["kld_p99"] == t["kld_p99"]
        ratio = f"{t['kld_p99'] / base_p99:.3g}x" if base_p99 and finite and name != "clean" else "-"
        rows.append(f"| {name} | {r['part']} ({r['what']}) | {_num(g['kld_mean'])} / {_num(g['kld_p99'])}, "
                    f"{'yes' if g['named'] else 'no'} | {_num(t['kld_mean'])} / {_num(t['kld_p99'])}, "
                    f"{'yes' if t['unexplained'] else 'no'}{nf} | {ratio} | {_first(r)} | {where} | {_searched(r)} | "
                    f"{_flips(r)} |")
    return "\n".join([f"`bench/bench_llama_bugs.py`, {res['build']}, F32 GGUF of tiny-needle-v2, on this "
                      "machine; raw numbers and every sentence in `bench/results/llama_bugs.json`. KLD: "
                      "decode path, 256/511/1023 tokens x 3 depths, exact (top-512 of 512). Replay: prefill, "
                      "240 tokens.", "", *rows])


def _num(x) -> str:
    return "n/a" if x is None or x != x else f"{x:.3g}"


def write_doc(res: dict) -> None:
    text = DOC.read_text()
    a, b = "<!-- bugs:start -->", "<!-- bugs:end -->"
    if a not in text:
        raise RuntimeError(f"{DOC} has no {a} marker")
    DOC.write_text(text[:text.index(a) + len(a)] + "\n" + render(res) + "\n" + text[text.index(b):])


def main() -> int:
    if "--render" in sys.argv:
        write_doc(json.loads(RESULTS.read_text()))
        return 0
    paths.require()
    OUT.mkdir(parents=True, exist_ok=True)
    fresh = set(sys.argv[sys.argv.index("--fresh") + 1].split(",")) if "--fresh" in sys.argv else set()
    res = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"build": paths.PINNED, "variants": {}}
    ck, model = gguf(MODEL, "f32")
    src, pristine = private_tree()
    if "--headlines" in sys.argv:                   # each stored headline again from its replay's findings file
        for name, v in res["variants"].items():
            f = OUT / name / "llamacpp-replay" / "findings-prefill-f16.json"
            if f.is_file():
                v["replay"]["headline"] = R.headline(json.loads(f.read_text()))
        RESULTS.write_text(json.dumps(res, indent=1, default=float))
        write_doc(res)
        return 0
    if "--replay" in sys.argv:                      # the replay again on every built variant
        for bug in BUGS:
            if bug.name in res["variants"]:
                res["variants"][bug.name]["replay"] = replay(bug, WORK / bug.name, ck, model)
                RESULTS.write_text(json.dumps(res, indent=1, default=float))
        write_doc(res)
        return 0
    for port, bug in enumerate(BUGS, 18800):
        if bug.name in res["variants"] and bug.name not in fresh:
            continue
        t0 = time.time()
        cached = (WORK / bug.name / "bin" / "llama-fidelity-dump").is_file()
        home = build_variant(bug, src, pristine)
        built = res["variants"].get(bug.name, {}).get("build_seconds") if cached else round(time.time() - t0)
        res["variants"][bug.name] = {**measure(bug, home, ck, model, port), "build_seconds": built}
        RESULTS.write_text(json.dumps(res, indent=1, default=float))      # after each variant: resumable
        print(bug.name, json.dumps(res["variants"][bug.name])[:300], flush=True)
    write_doc(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
