"""A streamed-checkpoint A/B with P prompts, before vs after in one run.

"before" is the lockstep of an earlier commit (default 14e7892: prompts one after another,
so every prompt re-reads and re-dequantises every layer, with the old dequantisation);
"after" is this tree (layer-major: each layer fetched once per pass for all prompts, the
fast dequantisation). Both run golden + engine on P prompts over the same synthetic
DeepSeek-native checkpoint (bench_streaming's layer shapes, fewer layers), streamed from
disk, prefill only, each in a fresh subprocess with the tree on PYTHONPATH: wall time and
layer fetches. Writes bench/results/streamed_ab.md.

    python bench/bench_streamed_ab.py [--before REV] [--prompts 6] [--layers 4] [--tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

BEFORE = "14e7892"
CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from fidelity.ab.lockstep import LockstepArm, LockstepRunner, Prompt, RunnerSettings
from kernel_toggles import ToggleSet
from reference_model import Numerics
from reference_model.checkpoint import StreamingWeights
path, P, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
w = StreamingWeights(path)
arms = [LockstepArm("golden", Numerics("reference"), role="golden"),
        LockstepArm("engine", ToggleSet.parse("engine").numerics())]
g = torch.Generator().manual_seed(0)
prompts = [Prompt(f"p{j}", torch.randint(2, w.cfg.vocab_size, (n,), generator=g)) for j in range(P)]
t = time.perf_counter()
res = LockstepRunner(w, arms, RunnerSettings(decode_steps=0)).run(prompts)
print(json.dumps({"seconds": time.perf_counter() - t, "loads": w.loads,
                  "kld_rows": len(res.kld), "kld_sum": sum(r["kld"] for r in res.kld)}))
"""


def child(tree: Path, ckpt: Path, prompts: int, tokens: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), str(prompts), str(tokens)], cwd=tree,
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=BEFORE)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    from bench_streaming import SyntheticWeights, bench_config
    from reference_model.checkpoint import save_checkpoint
    cfg = bench_config(a.layers)
    with tempfile.TemporaryDirectory() as tmp:
        ck = Path(tmp) / "ckpt"
        t = time.perf_counter()
        save_checkpoint(SyntheticWeights(cfg), ck)
        t_write = time.perf_counter() - t
        size = sum(p.stat().st_size for p in ck.glob("*.safetensors"))
        wt = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(wt), a.before], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            before = child(wt, ck, a.prompts, a.tokens)
            after = child(ROOT, ck, a.prompts, a.tokens)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=ROOT, check=False)
    same = before["kld_rows"] == after["kld_rows"] and abs(before["kld_sum"] - after["kld_sum"]) <= 1e-12 * max(1, abs(before["kld_sum"]))
    md = ["# Streamed-checkpoint A/B: before vs after", "",
          f"Measured {time.strftime('%Y-%m-%d %H:%M')} on this machine (2 cores, 1 torch thread per run). "
          f"Synthetic DeepSeek-native checkpoint: {cfg.n_layers} layers of dim {cfg.dim}, "
          f"{cfg.n_routed_experts} experts x {cfg.moe_inter_dim}, {size / 1e9:.2f} GB on disk (written in "
          f"{t_write:.0f} s). Golden + engine arms, {a.prompts} prompts of {a.tokens} tokens, prefill only, "
          f"streamed (one layer resident). 'before' = commit {a.before} (prompts one after another, old "
          "dequantisation); 'after' = this tree (layer-major, fast dequantisation).", "",
          "| run | layer fetches | wall s |", "|---|---:|---:|",
          f"| before | {before['loads']} | {before['seconds']:.1f} |",
          f"| after | {after['loads']} | {after['seconds']:.1f} |", "",
          f"Speed-up {before['seconds'] / after['seconds']:.1f}x; layer fetches {before['loads']} -> "
          f"{after['loads']} (= n_layers); final-logit KLD tables {'identical' if same else 'DIFFER'} "
          f"({after['kld_rows']} rows, sum {after['kld_sum']:.6g})."]
    out = ROOT / "bench" / "results" / "streamed_ab.md"
    out.write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
