"""The trained tiny needle model: the training forward is the golden model, the QAT grids
are the checkpoint writer's, a few training steps run, and the shipped checkpoint
reproduces its model card's recall."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reference_model import InMemoryWeights, Model, Numerics, random_weights
from reference_model.checkpoint import decode_fp4, decode_fp8, encode_fp4, encode_fp8
from reference_model.specs import all_specs
from reference_model.tokenizer import ASSISTANT, BOS, END_THINK, EOS, USER, load_tokenizer
from training import train_tiny
from training.data import HaystackSampler
from training.forward import TrainForward
from training.qat import effective_weights, fake_fp4, fake_fp8
from training.tiny_config import tiny_needle

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "models" / "tiny-needle"


def _fp32(w):
    return {k: (v.float() if v.is_floating_point() else v) for k, v in w.tensors.items()}


@pytest.mark.parametrize("sparse", [True, False])
def test_training_forward_is_the_golden_model(sparse):
    """Batched masked training forward == Model.extend (exact profile), token by token.
    Dense mode == the golden model with index_topk >= every compressed entry."""
    torch.set_num_threads(1)
    cfg = tiny_needle()
    tens = _fp32(random_weights(cfg, 1))
    T = 263                                  # not a multiple of the window or of 4
    toks = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    gcfg = cfg if sparse else cfg.replace(index_topk=T)
    m = Model(InMemoryWeights(gcfg, tens), Numerics("exact"))
    ref = torch.stack([m.extend(toks[b], None, "all")[0] for b in range(2)])
    out = TrainForward(cfg, Numerics("exact"))(tens, toks, sparse=sparse, kl_weight=torch.ones(2, T))
    assert (out.logits - ref).abs().max() < 1e-4 * ref.abs().max()
    assert set(out.index_kl) == {1, 3} and all(torch.isfinite(v) for v in out.index_kl.values())


def test_qat_grids_are_the_checkpoint_writers():
    """The fast fake-quant used every step gives exactly the values the writer stores."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g) * torch.logspace(-6, 2, 300)
    w[:, :5] = 0
    w[3, 7] = 448.0 * 2 ** -3                     # amax exactly on a power-of-two boundary
    assert torch.equal(fake_fp8(w), decode_fp8(*encode_fp8(w)).float())
    w4 = w[:, :288]
    assert torch.equal(fake_fp4(w4), decode_fp4(*encode_fp4(w4)).float())
    cfg = tiny_needle()
    params, buffers = train_tiny.init_params(cfg, 0)
    specs = {s.name: s for s in all_specs(cfg)}
    eff = effective_weights(params, specs, buffers)
    shipped = train_tiny.grid_weights(cfg, params, buffers).tensors
    for n in params:
        assert torch.equal(eff[n].detach().float(), shipped[n].float()), n
    # straight-through: the gradient reaches the fp32 master
    name = "layers.2.ffn.experts.3.w1.weight"
    eff[name].sum().backward()
    assert torch.equal(params[name].grad, torch.ones_like(params[name]))


def test_training_data_format():
    tok = load_tokenizer()
    s = HaystackSampler(tok, seed=5)
    tokens, lw, kw, exs = s.batch(6, 260, answer_kl_boost=3.0)
    for b, e in enumerate(exs):
        text = tok.decode(e.ids, skip_special_tokens=False)
        assert text.startswith(BOS + USER + "Some special magic numbers are hidden")
        first = tok.decode(e.ids[: e.n_prompt], skip_special_tokens=False)
        assert first.endswith("mentioned in the provided text?" + ASSISTANT + END_THINK)
        assert tok.decode(e.ids[e.n_prompt: e.answer_spans[0][1]], skip_special_tokens=False) == e.value + EOS
        assert "".join(tok.decode([e.ids[j]]) for j in e.value_tokens).strip() == e.value
        # the loss sits exactly on the positions predicting answers and their EOS
        assert int(lw[b].sum()) == sum(a1 - a0 for a0, a1 in e.answer_spans)
        assert bool((kw[b, : len(e.ids)] >= 1).all()) and bool((kw[b, len(e.ids):] == 0).all())
        assert text.count(USER) == len(e.answer_spans)


def test_a_few_training_steps(tmp_path):
    """Dense, sparse and QAT-activation steps run, the loss falls, and the result is a
    loadable DeepSeek-native checkpoint with the tokenizer beside it."""
    a = train_tiny.parse_args(["--steps", "4", "--dense-steps", "2", "--qat-act-steps", "1",
                               "--batch", "2", "--dense-len", "170", "190", "--sparse-len", "180", "200",
                               "--threads", "1", "--warmup", "1", "--print-every", "100",
                               "--out", str(tmp_path / "m")])
    res = train_tiny.train(a)
    log = res["log"]
    assert [r["phase"] for r in log] == ["dense", "dense", "sparse", "sparse+qat"]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in log)
    assert log[-1]["answer_ce"] < log[0]["answer_ce"]
    path = train_tiny.save(res, tmp_path / "m", a)
    from reference_model.checkpoint import load_checkpoint
    w = load_checkpoint(path)
    assert (path / "tokenizer.json").is_file() and w.cfg.replace(name="tiny-needle") == tiny_needle()
    assert torch.equal(w.tensors["layers.1.attn.wq_a.weight"].float(),
                       train_tiny.grid_weights(res["cfg"], res["params"], res["buffers"])
                       .tensors["layers.1.attn.wq_a.weight"].float())


@pytest.mark.skipif(not (SHIPPED / "eval" / "smoke.json").is_file(), reason="no shipped model")
def test_shipped_checkpoint_reproduces_model_card_recall(tmp_path):
    """Re-run the card's smoke cell (same sweep seed, so the same haystacks) on the shipped
    checkpoint in the golden `reference` profile; recall must fall in the card's interval."""
    from training.evaluate import Grid, load_target, summary, sweep
    torch.set_num_threads(2)
    card = json.loads((SHIPPED / "eval" / "smoke.json").read_text())
    rows = sweep(load_target(SHIPPED), Grid([card["length"]], card["depths"], card["reps"], card["seed"]),
                 tmp_path / "smoke.jsonl")
    r = summary(rows)["by_length"][0]
    assert r["n_scored"] == card["n"]
    assert card["ci_low"] <= r["recall"] <= card["ci_high"], (r, card)
