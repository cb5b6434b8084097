"""tiny-needle-v2: the multikey data mix (near-duplicate distractor keys), the warm start
from a shipped checkpoint, resumable snapshots, selection of an embedded model by name,
and the shipped v2 checkpoint reproduces its model card's recall."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from needle.keys import near_candidates, overlaps
from reference_model.specs import all_specs
from reference_model.tokenizer import ASSISTANT, END_THINK, USER, load_tokenizer
from training import train_tiny
from training.data import HaystackSampler, parse_mix
from training.qat import effective_weights

ROOT = Path(__file__).resolve().parents[1]
V1 = ROOT / "models" / "tiny-needle"
V2 = ROOT / "models" / "tiny-needle-v2"


def test_parse_mix():
    assert parse_mix("near=2,random=1,single=1") == (("near", 0.5), ("random", 0.25), ("single", 0.25))
    with pytest.raises(ValueError):
        parse_mix("nearby=1")


def test_mix_data_near_duplicate_keys():
    """Near haystacks: 2-4 needles whose other keys are near-duplicates of the queried one
    (never overlapping it), the first turn a sweep prompt asking for the queried key, every
    other key asked in a follow-up turn; single haystacks hold one needle."""
    tok = load_tokenizer()
    s = HaystackSampler(tok, seed=3, mix=(("near", 1.0),))
    for _ in range(6):
        e = s.example(400)
        text = tok.decode(e.ids, skip_special_tokens=False)
        first = tok.decode(e.ids[: e.n_prompt], skip_special_tokens=False)
        assert first.endswith("mentioned in the provided text?" + ASSISTANT + END_THINK)
        keys = [t.split(" is: ")[0] for t in text.split("special magic numbers for ")[1:]]
        assert 2 <= len(keys) <= 4 and len(e.answer_spans) == len(keys)
        queried = first.split("special magic number for ")[-1].split(" mentioned")[0]
        assert keys.count(queried) == 1
        near = {k for fam in near_candidates(queried) for k in fam}
        assert all(k in near and not overlaps(k, queried) for k in keys if k != queried)
        assert text.count(USER) == len(keys)
        assert f"for {queried} is: {e.value}." in text
    one = HaystackSampler(tok, seed=3, mix=(("single", 1.0),)).example(300)
    assert len(one.answer_spans) == 1


def test_v1_data_stream_unchanged_without_mix():
    """No --mix: the sampler draws exactly as before (v1 reproduces)."""
    tok = load_tokenizer()
    a = HaystackSampler(tok, seed=7).example(300)
    b = HaystackSampler(tok, seed=7, mix=None, multi_keys=(2, 4)).example(300)
    assert a.ids == b.ids


@pytest.mark.skipif(not (V1 / "config.json").is_file(), reason="no shipped v1 model")
def test_init_from_is_the_checkpoint():
    """--init-from: the masters are the checkpoint's weights, already on their grids, so the
    first training forward sees exactly the shipped tensors; the hash table is kept."""
    from reference_model.checkpoint import load_checkpoint
    a = train_tiny.parse_args(["--name", "tiny-needle-v2", "--index-topk", "8"])
    cfg = train_tiny.model_config(a)
    assert cfg.index_topk == 8 and cfg.name == "tiny-needle-v2"
    params, buffers = train_tiny.init_from_checkpoint(cfg, V1)
    w = load_checkpoint(V1).tensors
    eff = effective_weights(params, {s.name: s for s in all_specs(cfg)}, buffers)
    for n, t in eff.items():
        assert torch.equal(t.detach().float() if t.is_floating_point() else t,
                           w[n].float() if w[n].is_floating_point() else w[n]), n
    with pytest.raises(ValueError):
        train_tiny.init_from_checkpoint(cfg.replace(dim=128), V1)


def test_periodic_snapshot_resumes_the_same_run(tmp_path):
    """--snapshot-every writes masters + AdamW state; --resume from it continues with the
    same steps as the uninterrupted run (same data, same optimizer)."""
    common = ["--steps", "3", "--dense-steps", "2", "--qat-act-steps", "1", "--batch", "1",
              "--dense-len", "170", "180", "--sparse-len", "170", "180", "--threads", "1",
              "--warmup", "1", "--print-every", "100", "--reset-opt-at", "0",
              "--mix", "near=0.5,single=0.5", "--snapshot-dir", str(tmp_path / "s")]
    full = train_tiny.train(train_tiny.parse_args(common + ["--snapshot-every", "2",
                                                            "--log", str(tmp_path / "a.jsonl")]))
    assert (tmp_path / "s" / "ckpt2.pt").is_file()
    res = train_tiny.train(train_tiny.parse_args(common + ["--resume", str(tmp_path / "s" / "ckpt2.pt"),
                                                           "--resume-log", str(tmp_path / "a.jsonl")]))
    assert [r["step"] for r in res["log"]] == [0, 1, 2]
    assert res["log"][2]["loss"] == full["log"][2]["loss"]
    for n, w in full["params"].items():
        assert torch.equal(w, res["params"][n]), n


def test_portable_training_run_args():
    a = train_tiny.parse_args(["--log", "/tmp/x/train.jsonl", "--snapshot-dir", "/tmp/x/snap"])
    d = train_tiny.portable_args(a)
    assert d["log"] == "train.jsonl" and d["snapshot_dir"] == "snap" and d["resume"] is None


@pytest.mark.skipif(not (V2 / "config.json").is_file(), reason="no shipped v2 model")
def test_embedded_model_selected_by_name():
    from fidelity.weights.source import WeightsError, load_tokenizer_for, load_weights, resolve_checkpoint
    from fidelity.weights.target import load_target
    assert resolve_checkpoint("tiny-needle-v2") == V2
    assert resolve_checkpoint("embedded:tiny-needle-v2") == V2
    assert resolve_checkpoint("embedded:tiny-needle") == V1
    assert resolve_checkpoint(str(V2)) == V2
    with pytest.raises(WeightsError, match="tiny-needle-v2"):
        resolve_checkpoint("embedded:no-such-model")
    t = load_target("embedded:tiny-needle-v2")
    assert t.name == "tiny-needle-v2" and t.cfg.index_topk == 8
    w, label = load_weights("tiny-needle-v2", mode="dense")
    assert w.cfg.index_topk == 8 and label.startswith(str(V2))
    assert load_tokenizer_for("tiny-needle-v2") is not None
    assert load_weights(None)[1] == "embedded:tiny-needle"            # the default is v1


@pytest.mark.skipif(not (V2 / "eval" / "smoke.json").is_file(), reason="no shipped v2 model")
def test_shipped_v2_checkpoint_reproduces_model_card_recall(tmp_path):
    """Re-run the v2 card's smoke cell (multikey, near-duplicate distractors; same sweep seed,
    so the same haystacks) in the golden `reference` profile; recall must fall in the card's
    interval."""
    from needle.haystack import HaystackSpec
    from training.evaluate import Grid, load_target, summary, sweep
    torch.set_num_threads(2)
    card = json.loads((V2 / "eval" / "smoke.json").read_text())
    spec = HaystackSpec(**card["spec"])
    assert spec.kind == "multikey" and spec.distractors == "near"
    rows = sweep(load_target(V2), Grid([card["length"]], card["depths"], card["reps"], card["seed"]),
                 tmp_path / "smoke.jsonl", spec=spec)
    r = summary(rows)["by_length"][0]
    assert r["n_scored"] == card["n"]
    assert card["ci_low"] <= r["recall"] <= card["ci_high"], (r, card)
