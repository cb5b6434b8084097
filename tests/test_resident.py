"""Quantised-resident weights: the checkpoint's own tensors kept resident and dequantised
on use give bit-identical logits to the dense in-memory and the streamed paths (also
placed over two devices), hold about a quarter of the dequantised bytes, decode a layer
once per pass for all prompts and arms, and decode only the routed experts a batch
reaches; bad data is still named."""
import pandas as pd
import pytest
import torch

from fidelity.ab.lockstep import LockstepArm, LockstepRunner, Prompt, RunnerSettings
from kernel_toggles import ToggleSet
from reference_model import Model, Numerics, tiny
from reference_model.checkpoint import CheckpointError, StreamingWeights, load_checkpoint, save_checkpoint
from reference_model.resident import QuantisedResidentWeights
from reference_model.specs import FP4
from reference_model.weights import random_weights


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    p = tmp_path_factory.mktemp("ck") / "tiny"
    save_checkpoint(random_weights(tiny(), seed=4), p)
    return p


def _tokens(n, seed=0):
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("devices", [None, ["cpu", "cpu"]])
def test_bit_identical_to_dense_and_streamed(ckpt, devices):
    t = _tokens(140)
    dense = Model(load_checkpoint(ckpt), Numerics("reference")).prefill_logits(t)
    streamed = Model(StreamingWeights(ckpt), Numerics("reference")).prefill_logits(t)
    rq = QuantisedResidentWeights(ckpt, devices=devices)
    res = Model(rq, ToggleSet.parse("").numerics(), devices=devices).prefill_logits(t)
    assert torch.equal(dense, streamed) and torch.equal(dense, res)


def test_resident_bytes_are_the_checkpoints(ckpt):
    rq = QuantisedResidentWeights(ckpt)
    dense = load_checkpoint(ckpt)
    dense_bytes = sum(v.numel() * v.element_size() for v in dense.tensors.values())
    assert rq.resident_bytes == sum(h.nbytes for h in rq.info.tensors.values())
    assert rq.resident_bytes < 0.6 * dense_bytes


def test_only_routed_experts_are_decoded(ckpt):
    rq = QuantisedResidentWeights(ckpt)
    m = Model(rq, Numerics("reference"))
    _, st = m.extend(_tokens(200), None, "last")
    cfg = rq.cfg
    all_experts = cfg.n_layers * cfg.n_routed_experts * 3
    rq.decoded.clear()
    m.extend(torch.tensor([7]), st, "last")          # one token: top-k experts per layer
    assert rq.decoded.get(FP4, 0) <= cfg.n_layers * cfg.n_activated_experts * 3 < all_experts


def test_lockstep_decodes_each_layer_once_per_pass(ckpt):
    rq = QuantisedResidentWeights(ckpt)
    arms = [LockstepArm("golden", Numerics("reference"), role="golden"),
            LockstepArm("engine", ToggleSet.parse("engine").numerics())]
    ps = [Prompt("a", _tokens(90, 1)), Prompt("b", _tokens(60, 2))]
    a = LockstepRunner(rq, arms, RunnerSettings(decode_steps=1)).run(ps)
    assert rq.loads == 2 * rq.cfg.n_layers
    b = LockstepRunner(load_checkpoint(ckpt), arms, RunnerSettings(decode_steps=1)).run(ps)
    pd.testing.assert_frame_equal(pd.DataFrame(a.kld), pd.DataFrame(b.kld), check_exact=True)


def test_bad_data_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    p = tmp_path / "ck"
    save_checkpoint(random_weights(tiny(), seed=4), p)
    shard = sorted(p.glob("*.safetensors"))[0]
    t = load_file(shard)
    name = next(k for k in t if k.endswith(".scale"))
    t[name] = torch.full_like(t[name].view(torch.uint8), 255).view(t[name].dtype)
    save_file(t, shard)
    with pytest.raises(CheckpointError, match="E8M0 NaN byte 255"):
        QuantisedResidentWeights(p)


def test_ab_on_a_resident_quantised_checkpoint_equals_streamed(ckpt, tmp_path):
    from fidelity.cli import main
    out = {}
    for mode in ("streamed", "resident-quantised"):
        rc = main(["ab", "--checkpoint", str(ckpt), "--weights-mode", mode, "--arm", "engine",
                   "--shapley-top", "0", "--n-boot", "50", "--lengths", "70", "--reps", "2",
                   "--decode-steps", "1", "--out", str(tmp_path), "--run-id", mode])
        assert rc == 0
        out[mode] = pd.read_csv(tmp_path / mode / "kld.csv.gz")
    pd.testing.assert_frame_equal(out["streamed"], out["resident-quantised"], check_exact=True)
