"""Checkpoints as arms: `fidelity ab --weights base=DIR --weights other=DIR2` runs golden
numerics on each checkpoint in lockstep. A planted re-quantisation of one layer's routed
experts (coarser FP4 scales) is named: that layer is the first divergent one and the
verdict attributes the change (by outcome or by mechanism) to the weights arm; identical checkpoints name nothing; a
different architecture is refused."""
import json
import shutil

import pytest
import torch

from fidelity.cli import main
from reference_model import quant as Q
from reference_model.checkpoint import save_checkpoint
from reference_model.checkpoint_format import is_routed_expert
from reference_model.weights import InMemoryWeights, random_weights

from fidelity.weights.source import EMBEDDED
from reference_model.checkpoint import load_checkpoint

W = load_checkpoint(EMBEDDED)            # the trained tiny model: floors well below the plant
PLANTED = 2


def _coarser(w: torch.Tensor) -> torch.Tensor:
    """A careless FP4 re-quantisation: one scale per 128 inputs instead of 32, one power of
    two coarser than needed, then back on the checkpoint's FP4 grid."""
    x = w.float()
    blocks = x.unflatten(-1, (-1, 128))
    s = Q.pow2_ceil(blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 6.0) * 2
    coarse = (Q.round_to_e2m1((blocks / s).clamp(-6, 6)) * s).flatten(-2)
    v32, s32 = Q.quantize_fp4_weight(coarse)
    return (v32 * s32.repeat_interleave(32, -1)).to(torch.bfloat16)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("w")
    save_checkpoint(W, root / "base")
    save_checkpoint(W, root / "copy")
    t = dict(W.tensors)
    changed = 0
    for n in t:
        if n.startswith(f"layers.{PLANTED}.") and is_routed_expert(n):
            t[n] = _coarser(t[n])
            changed += int(not torch.equal(t[n], W.tensors[n]))
    assert changed > 0
    save_checkpoint(InMemoryWeights(W.cfg, t), root / "requant")
    for d in ("base", "copy", "requant"):        # needle haystack prompts, as the model was trained
        shutil.copy(EMBEDDED / "tokenizer.json", root / d / "tokenizer.json")
    return root


def _ab(tmp_path, root, other, run_id):
    rc = main(["ab", "--weights", f"base={root / 'base'}", "--weights", f"{other}={root / other}",
               "--arm", "golden", "--shapley-top", "0", "--n-boot", "200", "--lengths", "250",
               "--reps", "3", "--decode-steps", "1", "--out", str(tmp_path), "--run-id", run_id])
    assert rc == 0
    return json.loads((tmp_path / run_id / "manifest.json").read_text())


def test_planted_requantisation_is_named_at_its_layer(tmp_path, ckpts):
    m = _ab(tmp_path, ckpts, "requant", "requant")
    v = m["verdict"]
    # its KLD stays under the QAT floor at 250 tokens; what it changes inside (expert sets
    # past the planted layer) is a mechanism finding, judged against the reduction-order floor
    found = {n["toggle"] for n in v["named"]} | {f["toggle"] for f in v["mechanism"]}
    assert found == {"weights:requant"}, v["sentence"]
    (fd,) = [f for f in m["first_divergence"] if f["arm"] == "weights:requant"]
    assert fd["layer"] == PLANTED and fd["phase"] == "prefill"
    assert m["manifest"]["settings"]["design"]["weights_variants"] == [["requant", str(ckpts / "requant")]]


def test_identical_checkpoints_name_nothing(tmp_path, ckpts):
    m = _ab(tmp_path, ckpts, "copy", "null")
    assert m["verdict"]["culprit"] is None and m["verdict"]["named"] == [] and m["verdict"]["mechanism"] == []
    assert not [f for f in m["first_divergence"] if f["arm"] == "weights:copy"]


def test_another_architecture_is_refused(tmp_path, ckpts, capsys):
    other = tmp_path / "big"
    save_checkpoint(random_weights(W.cfg.replace(n_routed_experts=6), seed=1), other)
    rc = main(["ab", "--weights", f"base={ckpts / 'base'}", "--weights", f"big={other}", "--arm", "golden",
               "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "another architecture" in err and "n_routed_experts" in err
