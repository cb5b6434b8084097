"""Train the tiny DeepSeek-V4-architecture model on synthetic needle retrieval, then write
it as a DeepSeek-native checkpoint.

    python -m training.train_tiny --out models/tiny-needle          # the shipped run
    python -m training.train_tiny --steps 3 --dense-steps 1 --qat-act-steps 1 --procs 1 \
        --out /tmp/x                                             # smoke

tiny-needle-v2 is a warm start from it (`--init-from models/tiny-needle`, `--mix` of
single / random-key / near-duplicate-key haystacks, `--index-topk 8`); its two commands are
in models/tiny-needle-v2/MODEL_CARD.md.

Recipe (defaults = the shipped run; details in models/tiny-needle/MODEL_CARD.md):
1. steps 0-599, dense warm-up: CSA layers attend to every visible compressed entry; the
   lightning indexer learns to predict that attention by a KL loss (inputs detached);
2. steps 600-679, sparse: CSA layers attend to the indexer's top-k only, as at inference
   (indexer KL on the selected entries), with the `reference` activation numerics (bf16,
   FP8 act/KV, FP4 indexer) simulated under straight-through gradients; AdamW restarts at
   step 600 (so `--resume` from the step-600 snapshot is the same computation).
Weights are always seen on their checkpoint grids (FP8 128×128 / FP4 1×32 / bf16) with
straight-through gradients. Everything is seeded; same seed, same thread count, same
weights.

The parts: weights_init (masters and the shipped grid weights), run_state (one process's
TrainRun, set up or resumed), schedule (learning rate and batch length per step),
train_step (one step). This module is the command: the loop, its log and snapshots, the
data-parallel processes and the checkpoint it writes."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from reference_model.tokenizer import DEFAULT_PATH as TOKENIZER_PATH

from .run_state import TrainRun, model_config, resume_run, setup_run
from .train_step import train_step
from .weights_init import grid_weights, init_from_checkpoint, init_params

__all__ = ["grid_weights", "init_from_checkpoint", "init_params", "main", "model_config",
           "parse_args", "portable_args", "save", "train"]


def _log_step(run: TrainRun, rec: dict):
    """Keep the record, append it to --log, print every --print-every steps (rank 0)."""
    a, step = run.a, rec["step"]
    run.log.append(rec)
    if run.logf:
        run.logf.write(json.dumps(rec) + "\n")
        run.logf.flush()
    if run.rank == 0 and (step % a.print_every == 0 or step == a.steps - 1):
        print(f"{step:5d} L={rec['len']:4d} {rec['phase']:11s} ans {rec['answer_ce']:.3f} "
              f"lm {rec['lm_ce']:.3f} kl {rec['index_kl']:.3f} acc {rec['tok_acc']:.3f}/"
              f"{rec['seq_acc']:.2f} gn {rec['grad_norm']:.2f} hit "
              f"{'/'.join(f'{v:.2f}' for v in rec['hits'].values())} "
              f"{rec['elapsed_s']:.0f}s", flush=True)


def _snapshot_if_phase_end(run: TrainRun, step: int):
    """Master weights + buffers after the dense phase and before the QAT-activation steps
    (rank 0, --snapshot-dir): what --resume continues from. With --snapshot-every, also
    masters + AdamW state + step every that many steps (resumable mid-phase)."""
    a = run.a
    if not (run.rank == 0 and a.snapshot_dir):
        return
    if step + 1 in (a.dense_steps, a.steps - a.qat_act_steps):
        Path(a.snapshot_dir).mkdir(parents=True, exist_ok=True)
        torch.save({n: w.detach() for n, w in run.params.items()} | run.buffers,
                   Path(a.snapshot_dir) / f"step{step + 1}.pt")
    if a.snapshot_every and (step + 1) % a.snapshot_every == 0 and step + 1 < a.steps:
        Path(a.snapshot_dir).mkdir(parents=True, exist_ok=True)
        tmp = Path(a.snapshot_dir) / f"ckpt{step + 1}.pt.tmp"
        torch.save({"step": step + 1, "opt": run.opt.state_dict(),
                    "params": {n: w.detach() for n, w in run.params.items()} | run.buffers}, tmp)
        tmp.replace(tmp.with_suffix(""))


def train(a, rank: int = 0, world: int = 1) -> dict:
    run = setup_run(a, rank, world)
    try:
        if a.resume:
            resume_run(run)
        for step in range(run.first, a.steps):
            rec = train_step(run, step)
            _log_step(run, rec)
            _snapshot_if_phase_end(run, step)
    finally:
        if run.logf:
            run.logf.close()
    return {"cfg": run.cfg, "params": run.params, "buffers": run.buffers, "log": run.log,
            "train_seconds": time.time() - run.t0, "world": world}


def _worker(rank: int, world: int, port: int, a):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        res = train(a, rank, world)
        if rank == 0:
            print(f"trained {a.steps} steps in {res['train_seconds']:.0f}s on {world} processes",
                  flush=True)
            if not a.no_save:
                print(f"wrote {save(res, Path(a.out), a)}", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def portable_args(args) -> dict:
    """The run's arguments for training_run.json, with the scratch files it read or wrote
    (log, snapshots, resume points) reduced to their file names: no machine paths."""
    d = dict(vars(args))
    for k in ("log", "snapshot_dir", "resume", "resume_log"):
        if d.get(k):
            d[k] = Path(d[k]).name
    return d


def save(result, out_dir: Path, args) -> Path:
    from reference_model.checkpoint import save_checkpoint
    w = grid_weights(result["cfg"], result["params"], result["buffers"])
    path = save_checkpoint(w, out_dir, overwrite=True)
    shutil.copyfile(TOKENIZER_PATH, path / "tokenizer.json")
    (path / "training_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in result["log"]))
    meta = {"args": portable_args(args), "train_seconds": result["train_seconds"],
            "processes": result["world"], "threads_per_process": args.threads,
            "torch": torch.__version__}
    (path / "training_run.json").write_text(json.dumps(meta, indent=2) + "\n")
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="models/tiny-needle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--procs", type=int, default=2,
                   help="data-parallel processes (one thread each by default); the batch is split")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--steps", type=int, default=680)
    p.add_argument("--dense-steps", type=int, default=600)
    p.add_argument("--qat-act-steps", type=int, default=80)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dense-len", type=int, nargs=2, default=(200, 448),
                   help="first-turn prompt tokens, dense warm-up (min ~180: template + needles)")
    p.add_argument("--sparse-len", type=int, nargs=2, default=(320, 704),
                   help="first-turn prompt tokens, sparse phase = the training lengths")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--wd", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--lm-weight", type=float, default=0.1)
    p.add_argument("--kl-weight", type=float, default=1.0)
    p.add_argument("--answer-kl-boost", type=float, default=20.0)
    p.add_argument("--bias-rate", type=float, default=1e-3)
    p.add_argument("--print-every", type=int, default=25)
    p.add_argument("--log", default=None, help="JSONL training log while running")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--snapshot-dir", default=None, help="master weights at phase ends (.pt)")
    p.add_argument("--lr-total", type=int, default=1060, help="cosine horizon (steps)")
    p.add_argument("--cooldown", type=int, default=60, help="final linear LR cool-down steps")
    p.add_argument("--reset-opt-at", type=int, default=600,
                   help="restart AdamW (fresh moments) at this step (0: never)")
    p.add_argument("--resume", default=None,
                   help="snapshot written at step --reset-opt-at (equivalent to training from scratch)")
    p.add_argument("--resume-log", default=None, help="training log of the run that wrote the snapshot")
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="also snapshot masters + AdamW state every N steps (--resume continues there)")
    p.add_argument("--init-from", default=None,
                   help="warm start: a checkpoint dir whose (dequantised) weights become the fp32 "
                        "masters, and whose hash routing table is kept (e.g. models/tiny-needle)")
    p.add_argument("--name", default="tiny-needle", help="model name in the checkpoint config")
    p.add_argument("--index-topk", type=int, default=None,
                   help="CSA indexer top-k (default: tiny()'s 16); a config value, no weight shape")
    p.add_argument("--mix", default=None,
                   help="haystack kinds, e.g. near=0.5,random=0.2,single=0.3 (kinds: single, "
                        "random, near; default: v1's 1-3 random-key needles at 40/30/30%%)")
    p.add_argument("--multi-keys", type=int, nargs=2, default=(2, 4),
                   help="needles per random/near haystack of a --mix (inclusive range)")
    return p.parse_args(argv)



def main(argv=None):
    a = parse_args(argv)
    if a.procs > 1:
        import socket
        import torch.multiprocessing as mp
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        mp.spawn(_worker, args=(a.procs, port, a), nprocs=a.procs, join=True)
        return 0
    res = train(a)
    print(f"trained {a.steps} steps in {res['train_seconds']:.0f}s", flush=True)
    if not a.no_save:
        print(f"wrote {save(res, Path(a.out), a)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
