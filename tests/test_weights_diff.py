"""`fidelity weights-diff A B` (exit 0 identical, 1 different, 2 error, like cmp): two
writes of the same tiny weights are identical; a copy with one layer's routed experts 2
and 5 perturbed reports exactly that layer and those experts,
with rel L2 equal to the value computed here from the weight dicts; layouts (dense fp32,
NVFP4 experts) of the same values compare as identical; a different architecture and a
missing directory are exit 2 naming the problem."""
from __future__ import annotations

import json
import math
import shutil

import pandas as pd
import pytest
import torch

from fidelity.cli import main
from fidelity.weights.diff import compare_tensors, family
from reference_model import tiny
from reference_model.checkpoint import save_checkpoint, scan_checkpoint
from reference_model.specs import all_specs
from reference_model.weights import InMemoryWeights, random_weights, to_grid

from checkpoint_util import rewrite_shards, to_dense, to_nvfp4

CFG = tiny()
LAYER = 3                                   # a score-routed CSA layer (hash layers are 0, 1)
EXPERTS = {2: ("w1",), 5: ("w2", "w3")}     # expert -> the projections perturbed
W = random_weights(CFG, seed=11)


def _perturbed() -> tuple[InMemoryWeights, dict[str, float]]:
    """W with the EXPERTS' tensors of LAYER replaced by new FP4-grid values; and the rel L2
    of each replaced tensor computed here, in fp64, from the two dicts."""
    specs = {s.name: s for s in all_specs(CFG)}
    g = torch.Generator().manual_seed(5)
    tensors, want = dict(W.tensors), {}
    for e, ws in EXPERTS.items():
        for w in ws:
            name = f"layers.{LAYER}.ffn.experts.{e}.{w}.weight"
            old = W.tensors[name]
            noise = torch.randn(old.shape, generator=g) * old.float().std() * 0.3
            new = to_grid(specs[name], old.float() + noise)
            tensors[name] = new
            want[name] = float(torch.linalg.vector_norm(new.double() - old.double())
                               / torch.linalg.vector_norm(old.double()))
    return InMemoryWeights(CFG, tensors), want


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("wd")
    pw, want = _perturbed()
    return {"a": save_checkpoint(W, root / "a"), "a2": save_checkpoint(W, root / "a2"),
            "pert": save_checkpoint(pw, root / "pert"), "want": want, "root": root}


def _run(tmp_path, *argv):
    rc = main(["weights-diff", *map(str, argv), "--out", str(tmp_path), "--run-id", "r", "--quiet"])
    rep = tmp_path / "weights-diff" / "r"
    return rc, rep


def _tables(rep):
    return (pd.read_csv(rep / "tensors.csv.gz"), pd.read_csv(rep / "layers.csv"),
            pd.read_csv(rep / "experts.csv"), pd.read_csv(rep / "families.csv"),
            json.loads((rep / "manifest.json").read_text()))


def test_same_weights_written_twice_are_identical(ckpts, tmp_path, capsys):
    rc, rep = _run(tmp_path, ckpts["a"], ckpts["a2"])
    assert rc == 0
    t, layers, experts, fam, man = _tables(rep)
    n = len(all_specs(CFG))
    assert len(t) == n and t.identical.all() and not t.changed.any()
    assert (t.rel_l2 == 0).all() and (t.max_abs_diff == 0).all()
    assert list(layers.layer) == list(range(CFG.n_layers)) and (layers.changed == 0).all()
    assert len(experts) == CFG.n_layers * CFG.n_routed_experts and not experts.changed.any()
    assert (t.bytes_a == t.bytes_b).all()
    info = scan_checkpoint(ckpts["a"])
    assert man["totals"]["bytes_a"] == sum(h.nbytes for h in info.tensors.values())
    assert man["totals"]["changed"] == 0 and man["totals"]["identical"] == n
    # FP8 weight + E8M0 scale entries summed for one tensor
    row = t[t.tensor == "layers.0.attn.wq_a.weight"].iloc[0]
    assert row.dtype_a == "F8_E4M3+F8_E8M0"
    assert row.bytes_a == (info.tensors["layers.0.attn.wq_a.weight"].nbytes
                           + info.tensors["layers.0.attn.wq_a.scale"].nbytes)
    assert {"summary.md", "index.html", "families.csv", "max_rel_l2_per_layer.png"} <= {
        p.name for p in rep.iterdir()}
    assert "data:image/png;base64," in (rep / "index.html").read_text()
    assert "Same weights" in (rep / "summary.md").read_text()
    assert "Same weights" in capsys.readouterr().out


def test_perturbed_experts_named_with_independent_rel_l2(ckpts, tmp_path, capsys):
    rc, rep = _run(tmp_path, ckpts["a"], ckpts["pert"])
    assert rc == 1                                  # like diff/cmp: they differ
    t, layers, experts, fam, man = _tables(rep)
    want = ckpts["want"]
    changed = t[t.changed]
    assert set(changed.tensor) == set(want)
    for name, v in want.items():
        got = float(t.loc[t.tensor == name, "rel_l2"].iloc[0])
        assert v > 0.05 and got == pytest.approx(v, rel=1e-9), name
    assert not t[~t.tensor.isin(want)].changed.any() and t[~t.tensor.isin(want)].identical.all()
    # layers: exactly LAYER, with the experts named
    assert list(layers[layers.changed > 0].layer) == [LAYER]
    row = layers[layers.layer == LAYER].iloc[0]
    assert row.changed == 3 and row.changed_experts == "2 5" and row.n_changed_experts == 2
    assert row.max_rel_l2 == pytest.approx(max(want.values()), rel=1e-9)
    # experts: (LAYER, 2) and (LAYER, 5) only; expert 2's w2/w3 untouched
    ch = experts[experts.changed]
    assert sorted(zip(ch.layer, ch.expert)) == [(LAYER, 2), (LAYER, 5)]
    e2 = experts[(experts.layer == LAYER) & (experts.expert == 2)].iloc[0]
    assert e2.w2_rel_l2 == 0 and e2.w3_rel_l2 == 0 and e2.w1_rel_l2 > 0
    # families: expert ids and layer stripped
    f = fam.set_index("family")
    assert f.loc["ffn.experts.w1.weight", "changed"] == 1
    assert f.loc["ffn.experts.w2.weight", "changed"] == 1
    assert f.loc["ffn.experts.w1.weight", "tensors"] == CFG.n_layers * CFG.n_routed_experts
    assert f.loc["attn.wq_a.weight", "changed"] == 0
    assert man["totals"]["changed"] == 3 and man["totals"]["changed_layers"] == [LAYER]
    out = capsys.readouterr().out
    assert f"layer {LAYER}: 3/" in out and "experts 2,5" in out


def test_layers_and_tolerance(ckpts, tmp_path):
    rc, rep = _run(tmp_path, ckpts["a"], ckpts["pert"], "--layers", "0,1")
    t, layers, experts, _, man = _tables(rep)
    assert rc == 0 and list(layers.layer) == [0, 1] and not t.changed.any()
    assert t.layer.notna().all() and man["settings"]["globals"] is False
    top = max(ckpts["want"].values())
    rc, rep = _run(tmp_path, ckpts["a"], ckpts["pert"], "--layers", f"{LAYER},globals",
                   "--tolerance", str(top * 1.01))
    t, layers, *_ = _tables(rep)
    assert rc == 0 and not t.changed.any() and (~t.identical).sum() == 3
    assert "embed.weight" in set(t.tensor)
    rc, rep = _run(tmp_path, ckpts["a"], ckpts["pert"], "--layers", f"{LAYER}",
                   "--tolerance", str(min(ckpts["want"].values()) * 1.01))
    t = _tables(rep)[0]
    assert rc == 1 and 1 <= t.changed.sum() < 3     # some above the tolerance: they differ


@pytest.mark.parametrize("layout,convert", [("native-dense", to_dense), ("nvfp4-experts", to_nvfp4)])
def test_other_layout_same_values_is_identical(ckpts, tmp_path, layout, convert):
    ck = tmp_path / layout
    shutil.copytree(ckpts["a"], ck)
    rewrite_shards(ck, convert(W.tensors))
    assert scan_checkpoint(ck).layout == layout
    rc, rep = _run(tmp_path, ckpts["a"], ck)
    t, *_ , man = _tables(rep)
    assert rc == 0 and t.identical.all() and not t.changed.any()
    assert man["b"]["layout"] == layout
    e = t[t.tensor == "layers.1.ffn.experts.3.w1.weight"].iloc[0]
    if layout == "native-dense":
        assert e.dtype_b == "F32" and e.bytes_b == 4 * e.numel and e.bytes_b > e.bytes_a
    else:
        assert e.dtype_b == "U8+F8_E4M3+F32+F32" and e.mem_dtype_b == "float32"
        assert e.bytes_b == e.numel // 2 + e.numel // 16 + 8


def test_config_mismatch_is_exit_2_naming_fields(ckpts, tmp_path, capsys):
    small = CFG.replace(n_layers=2, compress_ratios=(0, 4), n_hash_layers=1)
    other = save_checkpoint(random_weights(small, seed=1), tmp_path / "small")
    rc, rep = _run(tmp_path, ckpts["a"], other)
    err = capsys.readouterr().err
    assert rc == 2 and not rep.exists()
    assert "different architectures" in err
    for k in ("n_layers", "compress_ratios", "n_hash_layers"):
        assert f"config mismatch: {k}:" in err
    assert "config mismatch: dim" not in err


def test_missing_checkpoint_and_bad_layers_are_exit_2(ckpts, tmp_path, capsys):
    missing = tmp_path / "nope"
    rc, rep = _run(tmp_path, ckpts["a"], missing)
    err = capsys.readouterr().err
    assert rc == 2 and not rep.exists()
    assert "checkpoint B" in err and str(missing) in err and "no such file or directory" in err
    rc, _ = _run(tmp_path, ckpts["a"], ckpts["a2"], "--layers", "7")
    assert rc == 2 and "outside the model's layers 0..4" in capsys.readouterr().err


def test_compare_tensors_chunked_against_direct():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1000, generator=g).to(torch.bfloat16)
    b = a.float().clone()
    b[::7] += 0.01
    for chunk in (64, 1000, 1 << 20):
        d = compare_tensors(a, b, chunk=chunk)
        ad, bd = a.double(), b.double()
        assert not d.identical
        assert d.rel_l2 == pytest.approx(float((ad - bd).norm() / ad.norm()), rel=1e-12)
        assert d.max_abs == float((ad - bd).abs().max())
    assert compare_tensors(a, a.float()).identical               # bf16 vs fp32, same values
    assert not compare_tensors(torch.zeros(3), -torch.zeros(3)).identical     # -0 is not 0
    assert compare_tensors(torch.zeros(3), torch.ones(3)).rel_l2 == math.inf
    nan = torch.tensor([1.0, float("nan")])
    assert math.isnan(compare_tensors(torch.ones(2), nan).rel_l2)
    assert family("layers.12.ffn.experts.7.w2.weight") == "ffn.experts.w2.weight"
    assert family("layers.0.ffn.shared_experts.w1.weight") == "ffn.shared_experts.w1.weight"
