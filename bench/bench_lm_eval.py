"""Real lm-evaluation-harness against `fidelity serve`: `local-completions` with its default
tokenizer settings (`tokenizer_backend=auto`, which finds /tokenizer_info + /tokenize and
uses the server's tokenizer), batch size 4, on a shipped 20-item multiple-choice needle
task (loglikelihood) and its generate_until twin, for the golden and engine arms of one
two-arm port. The truth is computed in-process from each arm's own Model: per item, the
choice with the largest summed continuation logprob (lm-eval's context/continuation split),
and the greedy answer cut at "."; lm-eval's accuracy and per-item picks must equal it.

lm-eval runs from its own venv (bench/out/evalvenv, created here on first use from PyPI,
never the project's .venv); nothing is downloaded at run time (HF offline, task data from
bench/lm_eval_task/). `--make-task` regenerates the shipped items (needle haystacks)."""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TASK_DIR = ROOT / "bench" / "lm_eval_task"
ITEMS = TASK_DIR / "needle_mc.jsonl"
VENV = ROOT / "bench" / "out" / "evalvenv"
LM_EVAL = "lm-eval[api]==0.4.13"
RESULTS = ROOT / "bench" / "results" / "lm_eval.md"
TASKS = ("needle_mc", "needle_gen")
GEN_STOP, GEN_MAX = ".", 16               # needle_gen.yaml's until / max_gen_toks


# ---- the shipped task -----------------------------------------------------------------------
def make_task(n: int = 20, seed: int = 26) -> None:
    """n single-needle prompts (completion format, 240-544 tokens, depths 0-100 %, the
    answer prefix ending in ':' as the model writes it): the needle's 7-digit value and
    three other 7-digit numbers as choices."""
    from fidelity.weights.target import load_target
    from needle.haystack import HaystackSpec, LocalCounter, PromptFormat, build_prompt

    tok = load_target(None).tokenizer
    rng = random.Random(seed)
    spec, fmt = HaystackSpec(kind="single"), PromptFormat(mode="completion")
    rows = []
    for i in range(n):
        p = build_prompt(spec, fmt, LocalCounter(tok), 240 + 16 * i, 100 * (i % 5) / 4, seed * 1000 + i)
        others = set()
        while len(others) < 3:                  # numbers the haystack does not contain
            v = str(rng.randint(1_000_000, 9_999_999))
            if v not in p.text:
                others.add(v)
        choices = [p.expected[0], *sorted(others)]
        rng.shuffle(choices)
        rows.append({"id": i, "text": p.text + ":", "choices": [" " + c for c in choices],
                     "gold": choices.index(p.expected[0]), "answer": " " + p.expected[0]})
    TASK_DIR.mkdir(parents=True, exist_ok=True)
    ITEMS.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def load_items() -> list[dict]:
    return [json.loads(ln) for ln in ITEMS.read_text().splitlines() if ln.strip()]


# ---- in-process truth -------------------------------------------------------------------------
def continuation_logprob(model, tok, context: str, continuation: str) -> tuple[float, int]:
    """Sum of log p(continuation tokens | context), split as lm-eval splits a pair: the
    whole string is encoded and the context's own token count marks where the
    continuation starts. Also the greedy next token after it (the one lm-eval's echo
    request samples and cuts off with [:-1])."""
    import torch
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    logits = model.prefill_logits(torch.tensor(whole))
    lp = torch.log_softmax(logits.double(), -1)
    return float(sum(lp[j - 1, whole[j]] for j in range(len(ctx), len(whole)))), int(lp[-1].argmax())


def truth(arm: str, items: list[dict]) -> dict:
    """Per item: every choice's loglikelihood, the pick, and the greedy generation."""
    from fidelity.design.arms import parse_arm
    from fidelity.weights.target import load_target
    from reference_model import Model
    from reference_model.generate import Decoder, Sampling

    t = load_target(None)
    tok, model = t.tokenizer, Model(t.weights, parse_arm(arm).numerics())
    out = []
    for it in items:
        scored = [continuation_logprob(model, tok, it["text"], c) for c in it["choices"]]
        lls = [ll for ll, _ in scored]
        d = Decoder(model, tok.encode(it["text"]), GEN_MAX, Sampling(0.0), {tok.eos_id},
                    should_stop=lambda ids: GEN_STOP in tok.decode(ids))
        text = tok.decode(d.run().tokens)
        text = text[:text.find(GEN_STOP)] if GEN_STOP in text else text
        out.append({"lls": lls, "pick": max(range(len(lls)), key=lambda k: lls[k]), "gen": text,
                    "eos_after_gold": scored[it["gold"]][1] == tok.eos_id})
    return {"acc": sum(o["pick"] == it["gold"] for o, it in zip(out, items)) / len(items),
            "exact_match": sum(_norm(o["gen"]) == _norm(it["answer"]) for o, it in zip(out, items)) / len(items),
            "eos_after_gold": sum(o["eos_after_gold"] for o in out), "items": out}


def _norm(s: str) -> str:
    """needle_gen.yaml's exact_match: whitespace and full stops ignored."""
    return "".join(s.split()).replace(".", "")


# ---- lm-eval --------------------------------------------------------------------------------------
def ensure_venv() -> Path:
    exe = VENV / "bin" / "lm_eval"
    if not exe.exists():
        print(f"creating {VENV} with {LM_EVAL} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", LM_EVAL], check=True)
    return exe


def run_lm_eval(exe: Path, url: str, model: str, out: Path, batch_size: int) -> dict:
    """lm-eval's own results and per-sample records for one served model."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(out / "hf"), "OPENAI_API_KEY": "not-checked"}
    cmd = [str(exe), "--model", "local-completions", "--model_args",
           f"model={model},base_url={url}/v1/completions,num_concurrent=1,max_retries=1",
           "--tasks", ",".join(TASKS), "--include_path", str(TASK_DIR), "--batch_size", str(batch_size),
           "--output_path", str(out), "--log_samples", "--seed", "0"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=TASK_DIR, env=env, capture_output=True, text=True)
    (out / "lm_eval.log").write_text(p.stdout + p.stderr)
    if p.returncode:
        raise SystemExit(f"lm-eval failed for {model} (exit {p.returncode}); log: {out / 'lm_eval.log'}\n"
                         + p.stderr[-3000:])
    res = json.loads(max(out.rglob("results_*.json"), key=lambda f: f.stat().st_mtime).read_text())
    samples = {}
    for task in TASKS:
        f = max(out.rglob(f"samples_{task}_*.jsonl"), key=lambda f: f.stat().st_mtime)
        samples[task] = sorted((json.loads(ln) for ln in f.read_text().splitlines()), key=lambda s: s["doc_id"])
    backend = "remote" if "Using remote tokenizer" in p.stderr + p.stdout else "unknown"
    return {"results": res["results"], "samples": samples, "seconds": time.perf_counter() - t0,
            "tokenizer_backend": backend}


def compare(items, tr: dict, ev: dict) -> dict:
    """lm-eval's numbers beside the truth: accuracy, per-item picks, loglikelihoods."""
    mc, gen = ev["samples"]["needle_mc"], ev["samples"]["needle_gen"]
    lls = [[float(r[0]) for r in s["filtered_resps"]] for s in mc]
    picks = [max(range(len(v)), key=lambda k: v[k]) for v in lls]
    dll = max(abs(a - b) for v, t in zip(lls, tr["items"]) for a, b in zip(v, t["lls"]))
    gens = [s["filtered_resps"][0] if isinstance(s["filtered_resps"][0], str) else s["filtered_resps"][0][0]
            for s in gen]
    return {"acc": ev["results"]["needle_mc"]["acc,none"],
            "exact_match": ev["results"]["needle_gen"]["exact_match,none"],
            "picks_equal": picks == [t["pick"] for t in tr["items"]],
            "gens_equal": [_norm(g) for g in gens] == [_norm(t["gen"]) for t in tr["items"]],
            "max_abs_ll_diff": dll, "n_items": len(items), "seconds": ev["seconds"],
            "tokenizer_backend": ev["tokenizer_backend"]}


def start_server(arms: list[str]):
    import socket
    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [a for arm in arms for a in ("--arm", f"{arm}={arm}")]
    proc = subprocess.Popen([sys.executable, "-m", "fidelity.cli", "serve", "--port", str(port), *args],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < 300:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit("server not healthy after 300 s")


def write_results(rows: dict, batch_size: int, path: Path) -> None:
    lines = ["# lm-eval against fidelity serve", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M')} on this machine. lm-evaluation-harness 0.4.13 "
             f"`local-completions`, default tokenizer settings (`auto` → `{rows['golden']['tokenizer_backend']}`: "
             f"the server's /tokenizer_info + /tokenize), batch size {batch_size}, one two-arm port "
             f"(`--arm golden=golden --arm engine=engine`), embedded tiny model; task: "
             f"`bench/lm_eval_task/` ({rows['golden']['n_items']} needle items, 4 choices, 240-544 tokens). "
             "Truth: each arm's in-process Model (summed continuation logprobs, lm-eval's context split; "
             "greedy generation cut at '.'). 'EOS next' = items whose gold answer the arm follows "
             "with EOS: lm-eval's echo request samples it and drops the last entry, so these items "
             "score right only if the EOS is in `token_logprobs` (issue 26: 0.40 before the fix).", "",
             "| arm | lm-eval acc | in-process acc | same picks | max abs Δ loglik | lm-eval exact_match "
             "| in-process exact_match | same generations | EOS next | lm-eval s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, r in rows.items():
        lines.append(f"| {arm} | {r['acc']:.2f} | {r['truth_acc']:.2f} | {'yes' if r['picks_equal'] else 'NO'} "
                     f"| {r['max_abs_ll_diff']:.1e} | {r['exact_match']:.2f} | {r['truth_exact_match']:.2f} "
                     f"| {'yes' if r['gens_equal'] else 'NO'} | {r['eos_after_gold']}/{r['n_items']} "
                     f"| {r['seconds']:.0f} |")
    lines += ["", "Reproduce: `.venv/bin/python bench/bench_lm_eval.py` (creates `bench/out/evalvenv` "
              "with lm-eval on first use; exits 1 if lm-eval and the truth disagree)."]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--make-task", action="store_true", help="regenerate the shipped task items and exit")
    ap.add_argument("--arms", default="golden,engine")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "lm_eval"))
    ap.add_argument("--results", default=str(RESULTS), help="results table (Markdown); '' = none")
    a = ap.parse_args()
    if a.make_task:
        make_task()
        print(f"wrote {ITEMS}")
        return 0
    import torch
    torch.set_num_threads(1)
    items, arms = load_items(), a.arms.split(",")
    exe = ensure_venv()
    proc, url = start_server(arms)
    rows = {}
    try:
        for arm in arms:
            print(f"== {arm}: lm-eval", flush=True)
            ev = run_lm_eval(exe, url, arm, Path(a.out) / arm, a.batch_size)
            print(f"== {arm}: in-process truth", flush=True)
            tr = truth(arm, items)
            rows[arm] = {**compare(items, tr, ev), "truth_acc": tr["acc"], "truth_exact_match": tr["exact_match"],
                         "eos_after_gold": tr["eos_after_gold"]}
            print(json.dumps(rows[arm]), flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "summary.json").write_text(json.dumps(rows, indent=1))
    if a.results:
        write_results(rows, a.batch_size, Path(a.results))
    ok = all(r["acc"] == r["truth_acc"] and r["picks_equal"] and r["gens_equal"]
             and r["exact_match"] == r["truth_exact_match"] and r["max_abs_ll_diff"] < 1e-6
             for r in rows.values())
    print("lm-eval equals the in-process truth" if ok else "MISMATCH between lm-eval and the truth")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
