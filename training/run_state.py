"""One training process (TrainRun): its arguments and rank, the model config, masters and
buffers, AdamW over its parameter groups, this rank's data streams, the two forwards and
the log; set up from the arguments (setup_run) or continued from a snapshot (resume_run)."""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from reference_model import Numerics
from reference_model.config import ModelConfig
from reference_model.specs import F32, all_specs
from reference_model.tokenizer import load_tokenizer

from .data import HaystackSampler, parse_mix
from .forward import TrainForward
from .qat import qat_numerics
from .schedule import length_at
from .tiny_config import tiny_needle
from .weights_init import init_from_checkpoint, init_params


class GradSync:
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
class TrainRun:
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
    sync: GradSync
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


def setup_run(a, rank: int, world: int) -> TrainRun:
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
    run = TrainRun(a, rank, world, cfg, params, buffers, specs, trained=list(trained.values()),
               decay=[w for n, w in trained.items() if is_decayed[n]],
               nodecay=[w for n, w in trained.items() if not is_decayed[n]],
               sampler=HaystackSampler(tok, seed=a.seed * 1000 + rank,
                                       mix=parse_mix(a.mix) if a.mix else None,
                                       multi_keys=tuple(a.multi_keys)),
               rng=random.Random(a.seed + 1),
               fwd_exact=TrainForward(cfg, Numerics("exact")), fwd_qat=TrainForward(cfg, qat_numerics()),
               sync=GradSync(world))
    run.opt = run.new_optimizer()
    run.t0, run.c0 = time.time(), time.process_time()
    run.logf = open(a.log, "w") if (a.log and rank == 0) else None
    return run


def resume_run(run: TrainRun):
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


def model_config(a) -> ModelConfig:
    """tiny_needle() with the run's name and (optional) indexer top-k."""
    cfg = tiny_needle().replace(name=a.name)
    return cfg if a.index_topk is None else cfg.replace(index_topk=a.index_topk)
