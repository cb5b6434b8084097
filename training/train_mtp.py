"""Train an MTP layer for a shipped tiny model on the model's own outputs, the main model
frozen (its shards are not rewritten: the MTP goes to a shard of its own).

Self-distillation: for a training text, the frozen golden gives the residual streams H[i]
and its next-token distribution at every position; the MTP at position i reads H[i] and
the token at i+1 and is trained (KL) towards the main model's distribution at i+1 -- the
very distribution a verifier samples, so what it learns is acceptance. Texts are the
model's training haystacks (training/data.py, the v2 mix) and filler continuations.
The Block starts from the main model's last layer (its attention and MoE, without the
compressor), the head from the main head's hc_head and norm; e_proj/h_proj from small
random values. QAT as training/qat.py: the forward sees exactly the shipped grid values.

    python -m training.train_mtp --model models/tiny-needle-v2 --steps 300 --write"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from reference_model import Model, Numerics
from reference_model.checkpoint import load_checkpoint
from reference_model.model import LayerState
from reference_model.mtp import MTP, block_config, mtp_specs
from reference_model.tokenizer import load_tokenizer

from .data import HaystackSampler, parse_mix
from .qat import effective_weights, qat_numerics, to_grid


def init_weights(main, cfg, seed: int) -> dict[str, torch.Tensor]:
    """fp32 masters named without `mtp.0.`: the Block from the last main layer, the head
    parts from the main head, the projections small and random, the norms ones."""
    g = torch.Generator().manual_seed(seed)
    last = main.layer_weights(cfg.n_layers - 1)
    out = {}
    for s in mtp_specs(cfg):
        n = s.name[len("mtp.0."):]
        if n in last:
            out[n] = last[n].float().clone()
        elif n in ("hc_head_fn", "hc_head_base", "hc_head_scale", "norm.weight"):
            out[n] = main.global_weights()[n].float().clone()
        elif n.endswith("norm.weight"):
            out[n] = torch.ones(s.shape)
        elif n == "ffn.gate.bias":
            out[n] = torch.zeros(s.shape)
        else:                                   # e_proj, h_proj
            out[n] = torch.randn(s.shape, generator=g) * (0.5 / s.shape[1] ** 0.5)
    return out


def texts(tok, n: int, seed: int, model: Model | None = None, gen: int = 48,
          lengths=(256, 768)) -> list[list[int]]:
    """Training texts: haystack examples (prompt, answers, follow-ups) of random length;
    with `model`, every other one is a haystack prompt and the model's own greedy
    continuation of `gen` tokens past its answer (what a served request decodes)."""
    from reference_model.generate import Decoder
    rng = random.Random(seed)
    hs = HaystackSampler(tok, seed=seed, mix=parse_mix("near=0.5,random=0.2,single=0.3"))
    out = []
    for j in range(n):
        ex = hs.example(rng.randint(*lengths))
        if model is None or j % 2 == 0:
            out.append(ex.ids)
        else:
            prompt = ex.ids[:ex.n_prompt]
            out.append(prompt + Decoder(model, prompt, gen).run().tokens)
    return out


@torch.no_grad()
def teacher(model: Model, ids: list[int]):
    """(streams H[0..n-2], next tokens ids[1..n-1], target log-probs at positions 1..n-1)."""
    t = torch.tensor(ids)
    H = model.extend(t, None, "hidden")[0]
    lp = torch.log_softmax(model.head(H[1:]).float(), -1)
    return H[:-1], t[1:], lp


def mtp_logits(mtp: MTP, own: dict, H, nxt, pos0: int = 0):
    """The MTP over one sequence from `pos0` with weights `own` (autograd through it):
    (logits, its output streams)."""
    X = mtp.prelude(H, nxt, own)
    out = mtp.runner._block(mtp.index, own, X, nxt, LayerState(), pos0, None, "prefill")
    return mtp.head(out, None, own), out


def kl(tgt, lg):
    lp = torch.log_softmax(lg.float(), -1)
    return (tgt.exp() * (tgt - lp)).sum(-1).mean()


def train(a) -> dict:
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    main = load_checkpoint(a.model)
    cfg = main.cfg
    tok = load_tokenizer(Path(a.model) / "tokenizer.json")
    golden = Model(main, Numerics("reference", torch.float32))
    data = [teacher(golden, ids) for ids in texts(tok, a.texts, a.seed, golden if a.own else None)]
    nx = qat_numerics()
    mtp = MTP(Model(main, nx), init_weights(main, cfg, a.seed))
    specs = {s.name[len("mtp.0."):]: s for s in mtp_specs(cfg)}
    params = {n: torch.nn.Parameter(v) for n, v in init_weights(main, cfg, a.seed).items()}
    opt = torch.optim.AdamW(params.values(), lr=a.lr, weight_decay=0.0)
    log, t0 = [], time.time()
    for step in range(a.steps):
        H, nxt, tgt = data[step % len(data)]
        w = effective_weights(params, specs, {})
        lg, out = mtp_logits(mtp, w, H, nxt)
        loss = kl(tgt, lg)
        if a.chain:           # draft 2: the MTP's own streams fed back, one position on
            lg2, _ = mtp_logits(mtp, w, out[:-1], nxt[1:], 1)
            loss = loss + a.chain * kl(tgt[1:], lg2)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        for gr in opt.param_groups:
            gr["lr"] = a.lr * min(1.0, (step + 1) / 20) * (1 - step / a.steps) ** 0.5
        opt.step()
        with torch.no_grad():
            acc = float((lg.argmax(-1) == tgt.argmax(-1)).float().mean())
        log.append({"step": step, "kl": float(loss.detach()), "top1_agree": acc, "t": round(time.time() - t0, 1)})
        if step % a.print_every == 0:
            print(json.dumps(log[-1]), flush=True)
    grid = {n: to_grid(specs[n], p.detach()) for n, p in params.items()}
    return {"weights": grid, "log": log, "cfg": block_config(cfg)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/tiny-needle-v2")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--texts", type=int, default=60)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--print-every", type=int, default=20)
    p.add_argument("--own", action="store_true",
                   help="half the texts: the model's own greedy continuations of haystack prompts")
    p.add_argument("--chain", type=float, default=0.0,
                   help="weight of the draft-2 loss (the MTP fed its own output streams)")
    p.add_argument("--log", default=None, help="write the step log (JSON lines) here")
    p.add_argument("--write", action="store_true", help="add the MTP shard to --model")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    res = train(a)
    if a.log:
        Path(a.log).write_text("".join(json.dumps(r) + "\n" for r in res["log"]))
    if a.write:
        from reference_model.mtp_write import add_mtp_layer
        print("wrote", add_mtp_layer(a.model, {n: v for n, v in res["weights"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
