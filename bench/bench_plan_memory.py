"""Memory plans for DeepSeek-V4-Flash (`fidelity plan-memory`, computed from the config:
nothing is loaded or measured): 8 x 96 GB and 1 x 141 GB, at 8K and 64K tokens, 6 prompts,
2 arms, resident-quantised weights. Writes bench/results/plan_memory.md.

    python bench/bench_plan_memory.py
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fidelity.weights.plan import (GiB, PassSpec, PlanDevices, per_sequence_line,  # noqa: E402
                                   plan_memory, render)
from reference_model.config import flash  # noqa: E402

SETUPS = [("8 x 96 GB", [f"cuda:{i}" for i in range(8)], "96GB"),
          ("1 x 141 GB", ["cuda:0"], "141GB")]
LENGTHS = (8192, 65536)
PROMPTS, ARMS, WEIGHTS = 6, 2, "resident-quantised"


def main() -> int:
    cfg = flash()
    plans = [(label, n, plan_memory(cfg, PlanDevices(devs, mem), PassSpec(n, PROMPTS, ARMS, WEIGHTS)))
             for label, devs, mem in SETUPS for n in LENGTHS]
    by_len = {p.length: p for _, _, p in plans}
    L = ["# Memory plans for DeepSeek-V4-Flash", "",
         "`python bench/bench_plan_memory.py` = `fidelity plan-memory --preset flash --batch "
         f"{PROMPTS} --n-arms {ARMS} --weights-mode {WEIGHTS}` per setup, computed from the config "
         "(fidelity/weights/plan.py; nothing loaded or measured). Profile reference (state in "
         "fp64 except the fp32 indexer keys, bf16 streams), logits of every position compared a "
         "head chunk of 2048 positions at a time (fidelity/ab/head.py), "
         "placement balanced by weight bytes. GiB = 2^30 bytes; 96 GB = 89.41 GiB, "
         "141 GB = 131.32 GiB. " + " ".join(per_sequence_line(by_len[n]) for n in LENGTHS),
         "",
         "| devices | tokens | verdict | tightest device | needs GiB | budget GiB |",
         "|---|---:|---|---|---:|---:|"]
    for label, n, p in plans:
        t = max(p.devices, key=lambda d: d.total - d.budget)
        L.append(f"| {label} | {n} | {'fits' if p.fits else 'does not fit'} | {t.device} | "
                 f"{t.total / GiB:.2f} | {t.budget / GiB:.2f} |")
    for label, n, p in plans:
        L += ["", render(p, f"#### {label}, {n} tokens", full=False)]
    out = ROOT / "bench" / "results" / "plan_memory.md"
    out.write_text("\n".join(L) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
