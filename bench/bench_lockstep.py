"""Lockstep overhead: N arms run layer by layer (with per-layer metrics) vs N separate
golden forwards. Target: <= 1.15x. Writes bench/results/lockstep.md."""
from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fidelity.ab.lockstep import LockstepArm, LockstepRunner, Prompt, RunnerSettings  # noqa: E402
from reference_model import Model, Numerics, random_weights, tiny  # noqa: E402


def main(length=1024, n_arms=4, decode_steps=4, repeats=2):
    cfg = tiny()
    w = random_weights(cfg, 0)
    toks = torch.randint(2, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(1))
    prompt = Prompt("p", toks)
    arms = [LockstepArm("golden", Numerics(), role="golden")] + [LockstepArm(f"copy{i}", Numerics()) for i in range(n_arms - 1)]

    def single():
        m = Model(w, Numerics())
        lg, st = m.extend(toks, logits="all")
        nxt = int(lg[-1].argmax())
        for _ in range(decode_steps):
            lg, st = m.extend(torch.tensor([nxt]), st)
            nxt = int(lg[-1].argmax())

    def lockstep():
        LockstepRunner(w, arms, RunnerSettings(decode_steps=decode_steps)).run([prompt])

    single()
    t_single = min(_time(single) for _ in range(repeats))
    t_lock = min(_time(lockstep) for _ in range(repeats))
    ratio = t_lock / (n_arms * t_single)
    text = (f"# Lockstep overhead\n\ntiny preset, {length}-token prefill + {decode_steps} decode steps, "
            f"{n_arms} arms, {platform.machine()}, torch {torch.__version__}.\n\n"
            f"| measure | seconds |\n|---|---:|\n| one golden forward | {t_single:.2f} |\n"
            f"| {n_arms} arms in lockstep (default taps + metrics) | {t_lock:.2f} |\n"
            f"| ratio to {n_arms} single forwards | {ratio:.3f} |\n")
    (ROOT / "bench" / "results" / "lockstep.md").write_text(text)
    print(text)


def _time(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
