"""One training step of a TrainRun: the batch (AdamW restart, learning rate, haystacks),
the forward on the grid weights and the loss, backward + AdamW, the rank-averaged
statistics with the expert balancing, and the step's training-log record."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .forward import ForwardOut
from .qat import effective_weights
from .run_state import TrainRun
from .schedule import length_at, lr_at


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


def _next_batch(run: TrainRun, step: int) -> _Batch:
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


def _forward_loss(run: TrainRun, b: _Batch) -> _Loss:
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


def _optimizer_step(run: TrainRun, loss: torch.Tensor) -> torch.Tensor:
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
def _stats_and_balance(run: TrainRun, b: _Batch, l: _Loss) -> tuple[torch.Tensor, dict]:
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


def train_step(run: TrainRun, step: int) -> dict:
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
