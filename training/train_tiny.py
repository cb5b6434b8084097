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
weights."""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from reference_model import InMemoryWeights, Numerics
from reference_model.config import ModelConfig
from reference_model.specs import F32, I64, all_specs
from reference_model.tokenizer import DEFAULT_PATH as TOKENIZER_PATH
from reference_model.tokenizer import load_tokenizer

from .data import HaystackSampler, parse_mix
from .forward import ForwardOut, TrainForward
from .qat import effective_weights, qat_numerics, to_grid
from .tiny_config import tiny_needle


# ---- init --------------------------------------------------------------------------------
def init_params(cfg: ModelConfig, seed: int):
    """Master weights (fp32 leaves) and fixed buffers (hash routing table), keyed by native
    name. Residual-friendly: mHC starts as 'average the streams in, add the block output to
    every stream, keep each stream' (mixing GEMMs near zero), output projections small."""
    g = torch.Generator().manual_seed(seed)
    hc = cfg.hc_mult
    params, buffers = {}, {}
    for s in all_specs(cfg):
        n, shape = s.name, s.shape
        if s.fmt == I64:                                    # tid2eid: distinct experts per token
            rows = [torch.randperm(cfg.n_routed_experts, generator=g)[: shape[1]] for _ in range(shape[0])]
            buffers[n] = torch.stack(rows).long()
            continue
        if n.endswith("norm.weight"):
            t = torch.ones(shape)
        elif n.endswith("_fn"):
            t = torch.randn(shape, generator=g) * (0.02 / math.sqrt(shape[1]))
        elif n.endswith("_scale"):
            t = torch.ones(shape)
        elif n.endswith("hc_head_base"):
            t = torch.zeros(shape)
        elif n.endswith("_base"):
            t = torch.zeros(shape)
            t[:hc] = math.log(1 / (hc - 1))                  # sigmoid = 1/hc: mean of the streams
            t[2 * hc:] = 4.0 * torch.eye(hc).flatten()        # comb ~ identity
        elif n.endswith(("attn_sink", "ape", "gate.bias")):
            t = torch.zeros(shape)
        elif n == "embed.weight":
            t = torch.randn(shape, generator=g)
        else:                                               # linear [out, in]
            t = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
            if n.endswith(("wo_b.weight", "w2.weight")):
                t = t / math.sqrt(2 * cfg.n_layers)
        params[n] = t.float().requires_grad_(True)
    return params, buffers


def init_from_checkpoint(cfg: ModelConfig, path):
    """Warm start (--init-from): the masters are a shipped checkpoint's dequantised weights
    (fp32; they already sit on their grids, so the first forward sees exactly that
    checkpoint), the buffers (hash routing table) are the checkpoint's. `cfg` may differ
    from the checkpoint's config only in name and index_topk (no weight shape depends on
    them)."""
    from reference_model.checkpoint import load_checkpoint
    w = load_checkpoint(Path(path))
    if w.cfg.replace(name=cfg.name, index_topk=cfg.index_topk) != cfg:
        raise ValueError(f"--init-from {path}: its config differs from {cfg.name}'s beyond "
                         "name and index_topk")
    params, buffers = {}, {}
    for s in all_specs(cfg):
        t = w.tensors[s.name]
        if s.fmt == I64:
            buffers[s.name] = t.long().clone()
        else:
            params[s.name] = t.float().clone().requires_grad_(True)
    return params, buffers


def grid_weights(cfg, params, buffers) -> InMemoryWeights:
    """The shipped weights: masters snapped onto the checkpoint grids, in the in-memory
    dtypes of the reader (bf16 for FP8/FP4/bf16 tensors, fp32, int64)."""
    specs = {s.name: s for s in all_specs(cfg)}
    t = dict(buffers)
    for n, w in params.items():
        v = to_grid(specs[n], w)
        t[n] = v.float() if specs[n].fmt == F32 else v.to(torch.bfloat16)
    return InMemoryWeights(cfg, t)


def needle_hits(topk: dict, exs) -> dict[int, float]:
    """Per CSA layer: fraction of examples whose first question position has a compressed
    entry holding the queried value among the indexer's top-k (entry j pools tokens
    4j..4j+3 and, in half its channels, 4j-4..4j-1)."""
    res = {}
    for i, sel in topk.items():
        hits = []
        for b, e in enumerate(exs):
            q = e.n_prompt - 1
            own = {t // 4 for t in e.value_tokens}
            held = {j for j in own | {j + 1 for j in own} if j < (q + 1) // 4}
            hits.append(bool(held & set(sel[b, q].tolist())))
        res[i] = sum(hits) / len(hits)
    return res


# ---- schedule ----------------------------------------------------------------------------
def lr_at(step, total, peak, warmup, steps=None, cooldown=0):
    """Linear warm-up, cosine to 10% at `total`, then (optional) a linear cool-down to 10%
    of that over the last `cooldown` of `steps`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    lr = peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
    if cooldown and steps is not None and step >= steps - cooldown:
        lr *= 1 - 0.9 * (step - (steps - cooldown) + 1) / cooldown
    return lr


def length_at(step, a, rng):
    """Training length of a batch: uniform in the phase's range."""
    lo, hi = a.dense_len if step < a.dense_steps else a.sparse_len
    return rng.randint(lo, hi)


# ---- main loop ---------------------------------------------------------------------------
class _Sync:
    """Gradient / statistics averaging over data-parallel ranks (gloo on loopback); a
    no-op for one process. Both ranks then take the same optimizer step, so they hold
    identical weights without broadcasting them."""

    def __init__(self, world: int):
        self.world = world

    def mean_(self, tensors: list[torch.Tensor]):
        if self.world == 1:
            return
        import torch.distributed as dist
        flat = torch.cat([t.flatten() for t in tensors])
        dist.all_reduce(flat)
        flat /= self.world
        i = 0
        for t in tensors:
            t.copy_(flat[i:i + t.numel()].view_as(t))
            i += t.numel()


@dataclass
class _Run:
    """One training process: its arguments and rank, the model, the optimizer, the data
    streams, the forwards and the log."""
    a: argparse.Namespace
    rank: int
    world: int
    cfg: ModelConfig
    params: dict                        # native name -> fp32 master (requires grad)
    buffers: dict                       # native name -> fixed tensor (hash routing table)
    specs: dict                         # native name -> TensorSpec
    trained: list                       # every master but the gate biases (params order)
    decay: list                         # the trained 2-D grid weights (AdamW weight decay)
    nodecay: list                       # the other trained tensors
    sampler: HaystackSampler            # this rank's haystacks
    rng: random.Random                  # batch lengths, the same on every rank
    fwd_exact: TrainForward
    fwd_qat: TrainForward
    sync: _Sync
    opt: torch.optim.AdamW | None = None
    first: int = 0                      # first step this run trains (> 0 on --resume)
    log: list = field(default_factory=list)
    t0: float = 0.0                     # wall / CPU clock origins of elapsed_s / cpu_s
    c0: float = 0.0
    logf: object = None                 # the --log file (rank 0)

    def new_optimizer(self) -> torch.optim.AdamW:
        return torch.optim.AdamW([{"params": self.decay, "weight_decay": self.a.wd},
                                  {"params": self.nodecay, "weight_decay": 0.0}],
                                 lr=self.a.lr, betas=(0.9, 0.95), eps=1e-8)


def _setup(a, rank: int, world: int) -> _Run:
    """Seeds, model init, AdamW parameter groups (the gate biases follow the balancing
    rule, not the gradient), this rank's data streams, the two forwards."""
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    cfg = model_config(a)
    tok = load_tokenizer()
    params, buffers = (init_from_checkpoint(cfg, a.init_from) if a.init_from
                       else init_params(cfg, a.seed))
    specs = {s.name: s for s in all_specs(cfg)}
    trained = {n: w for n, w in params.items() if not n.endswith("gate.bias")}
    is_decayed = {n: specs[n].fmt != F32 and w.dim() == 2 for n, w in trained.items()}
    run = _Run(a, rank, world, cfg, params, buffers, specs, trained=list(trained.values()),
               decay=[w for n, w in trained.items() if is_decayed[n]],
               nodecay=[w for n, w in trained.items() if not is_decayed[n]],
               sampler=HaystackSampler(tok, seed=a.seed * 1000 + rank,
                                       mix=parse_mix(a.mix) if a.mix else None,
                                       multi_keys=tuple(a.multi_keys)),
               rng=random.Random(a.seed + 1),
               fwd_exact=TrainForward(cfg, Numerics("exact")), fwd_qat=TrainForward(cfg, qat_numerics()),
               sync=_Sync(world))
    run.opt = run.new_optimizer()
    run.t0, run.c0 = time.time(), time.process_time()
    run.logf = open(a.log, "w") if (a.log and rank == 0) else None
    return run


def _resume(run: _Run):
    """Continue from a snapshot: same weights, and the data streams fast-forwarded to the
    same place. A phase-end snapshot (no optimizer state) continues at --reset-opt-at with
    a fresh optimizer, as --reset-opt-at does; a --snapshot-every snapshot continues at its
    step with its AdamW state (fresh if that step is --reset-opt-at)."""
    a = run.a
    snap = torch.load(a.resume)
    if "step" in snap:                          # periodic snapshot: masters + AdamW + step
        run.first = snap["step"]
        if run.first != a.reset_opt_at:
            run.opt.load_state_dict(snap["opt"])
        snap = snap["params"]
    else:
        run.first = a.reset_opt_at
    with torch.no_grad():
        for n, w in run.params.items():
            w.copy_(snap[n])
    for step in range(run.first):
        run.sampler.batch(a.batch // run.world, length_at(step, a, run.rng), a.answer_kl_boost)
    if a.resume_log:
        run.log = [json.loads(x) for x in Path(a.resume_log).read_text().splitlines()][:run.first]
        run.t0 -= run.log[-1]["elapsed_s"]
        run.c0 -= run.log[-1]["cpu_s"]


@dataclass
class _Batch:
    """What one step trains on, and how."""
    step: int
    length: int                         # first-turn prompt tokens asked of the sampler
    sparse: bool                        # CSA layers attend to the indexer's top-k only
    qat_act: bool                       # `reference` activation numerics (straight-through)
    lr: float
    tokens: torch.Tensor                # [B, T]
    lw: torch.Tensor                    # answer loss weights [B, T]
    kw: torch.Tensor                    # index-KL weights [B, T] (0 on padding)
    exs: list


def _next_batch(run: _Run, step: int) -> _Batch:
    """Restart AdamW if due, set this step's learning rate, draw the batch."""
    a = run.a
    if run.world > 1 and os.getppid() == 1:     # launcher gone: do not train on as an orphan
        raise SystemExit("training launcher exited; stopping this worker")
    if step == a.reset_opt_at and step > 0 and not (a.resume and step == run.first):
        run.opt = run.new_optimizer()
    lr = lr_at(step, a.lr_total or a.steps, a.lr, a.warmup, a.steps, a.cooldown)
    for gr in run.opt.param_groups:
        gr["lr"] = lr
    L = length_at(step, a, run.rng)
    sparse, qat_act = step >= a.dense_steps, step >= a.steps - a.qat_act_steps
    tokens, lw, kw, exs = run.sampler.batch(a.batch // run.world, L, a.answer_kl_boost)
    return _Batch(step, L, sparse, qat_act, lr, tokens, lw, kw, exs)


@dataclass
class _Loss:
    out: ForwardOut
    logits: torch.Tensor                # [B, T-1, V] fp32, predicting tgt
    tgt: torch.Tensor                   # [B, T-1]
    aw: torch.Tensor                    # answer weights of the targets [B, T-1]
    loss: torch.Tensor                  # ans + lm_weight * lm + kl_weight * kl
    ans: torch.Tensor                   # cross-entropy on the answers and their EOS
    lm: torch.Tensor                    # cross-entropy on every other real token
    kl: torch.Tensor                    # indexer KL, mean over CSA layers


def _forward_loss(run: _Run, b: _Batch) -> _Loss:
    """Forward on the grid weights (exact or QAT activations) and the training loss."""
    a = run.a
    w = effective_weights(run.params, run.specs, run.buffers)
    fwd = run.fwd_qat if b.qat_act else run.fwd_exact
    out = fwd(w, b.tokens, sparse=b.sparse, kl_weight=b.kw)
    logits = out.logits[:, :-1].float()
    tgt = b.tokens[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                         reduction="none").view_as(tgt)
    aw = b.lw[:, :-1]
    ans = (ce * aw).sum() / aw.sum()
    real = (b.kw[:, :-1] > 0).float() * (1 - aw)
    lm = (ce * real).sum() / real.sum()
    kl = sum(out.index_kl.values()) / max(1, len(out.index_kl))
    loss = ans + a.lm_weight * lm + a.kl_weight * kl
    return _Loss(out, logits, tgt, aw, loss, ans, lm, kl)


def _optimizer_step(run: _Run, loss: torch.Tensor) -> torch.Tensor:
    """Backward, gradients averaged over ranks, clipped, one AdamW step; the grad norm."""
    plist = run.trained              # clip_grad_norm_ sums the norms in this order
    run.opt.zero_grad(set_to_none=False)
    loss.backward()
    for p in plist:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    run.sync.mean_([p.grad for p in plist])
    gn = torch.nn.utils.clip_grad_norm_(plist, run.a.clip)
    run.opt.step()
    return gn


@torch.no_grad()
def _stats_and_balance(run: _Run, b: _Batch, l: _Loss) -> tuple[torch.Tensor, dict]:
    """Rank-averaged [loss, ans, lm, kl, tok_acc, seq_acc, hit layer 1, hit layer 3] and
    this rank's needle hits; then the aux-loss-free expert balancing (DeepSeek-V3) on the
    rank-averaged expert loads."""
    hit = (l.logits.argmax(-1) == l.tgt).float()
    aw = l.aw
    hits = needle_hits(l.out.topk, b.exs)
    stats = torch.tensor([float(l.loss), float(l.ans), float(l.lm), float(l.kl),
                          float((hit * aw).sum() / aw.sum()),
                          float((((hit * aw).sum(1) == aw.sum(1)).float()).mean())]
                         + [hits.get(i, 0.0) for i in (1, 3)])
    loads = {i: v.float() for i, v in l.out.expert_load.items()}
    run.sync.mean_([stats] + list(loads.values()))
    for i, load in loads.items():
        bias = run.params[f"layers.{i}.ffn.gate.bias"]
        bias += run.a.bias_rate * torch.sign(load.mean() - load)
    return stats, hits


def _train_step(run: _Run, step: int) -> dict:
    """One step: batch, loss, AdamW, balancing; its training-log record."""
    b = _next_batch(run, step)
    l = _forward_loss(run, b)
    gn = _optimizer_step(run, l.loss)
    stats, hits = _stats_and_balance(run, b, l)
    return {"step": step, "len": b.length, "tokens": int(b.tokens.shape[1]),
            "phase": ("sparse" if b.sparse else "dense") + ("+qat" if b.qat_act else ""),
            "lr": b.lr, "loss": float(stats[0]), "answer_ce": float(stats[1]),
            "lm_ce": float(stats[2]), "index_kl": float(stats[3]), "tok_acc": float(stats[4]),
            "seq_acc": float(stats[5]), "grad_norm": float(gn),
            "elapsed_s": time.time() - run.t0, "cpu_s": time.process_time() - run.c0,
            "hits": {str(i): float(stats[6 + j]) for j, i in enumerate((1, 3)) if i in hits}}


def _log_step(run: _Run, rec: dict):
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


def _snapshot_if_phase_end(run: _Run, step: int):
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
    run = _setup(a, rank, world)
    try:
        if a.resume:
            _resume(run)
        for step in range(run.first, a.steps):
            rec = _train_step(run, step)
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


def model_config(a) -> ModelConfig:
    """tiny_needle() with the run's name and (optional) indexer top-k."""
    cfg = tiny_needle().replace(name=a.name)
    return cfg if a.index_topk is None else cfg.replace(index_topk=a.index_topk)


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
