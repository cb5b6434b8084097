"""Checkpoint layouts beyond DeepSeek's FP8/FP4 release (docs/weight-formats.md): native
names with the quantised tensors stored dequantised (bf16 / fp32, no scales) and NVIDIA
ModelOpt NVFP4 routed experts. Fixtures are written here from the tiny model; values that
are identical load to bit-identical logits; NVFP4 dequantisation checked by hand; bad
scales and mixed formats named."""

import pytest
import torch

from reference_model import Model, Numerics, tiny
from reference_model import quant as Q
from reference_model.checkpoint import (CheckpointError, StreamingWeights, load_checkpoint, save_checkpoint,
                                        scan_checkpoint)
from reference_model.checkpoint_format import is_routed_expert
from reference_model.resident import QuantisedResidentWeights
from reference_model.weights import random_weights

from checkpoint_util import rewrite_shards, to_dense, to_nvfp4

W = random_weights(tiny(), seed=6)
TOKENS = torch.randint(2, 500, (120,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def golden():
    return Model(W, Numerics("reference")).prefill_logits(TOKENS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_dense_loads_bit_identical(tmp_path, golden, dtype):
    ck = tmp_path / "dense"
    save_checkpoint(W, ck)
    rewrite_shards(ck, to_dense(W.tensors, dtype))
    info = scan_checkpoint(ck)
    assert info.layout == "native-dense" and any("native-dense" in x for x in info.notes)
    for src in (load_checkpoint(ck), StreamingWeights(ck), QuantisedResidentWeights(ck)):
        assert torch.equal(Model(src, Numerics("reference")).prefill_logits(TOKENS), golden)


def test_nvfp4_experts_load_bit_identical(tmp_path, golden):
    ck = tmp_path / "nvfp4"
    save_checkpoint(W, ck)
    rewrite_shards(ck, to_nvfp4(W.tensors))
    info = scan_checkpoint(ck)
    assert info.layout == "nvfp4-experts"
    for src in (load_checkpoint(ck), QuantisedResidentWeights(ck)):
        assert torch.equal(Model(src, Numerics("reference")).prefill_logits(TOKENS), golden)


def test_nvfp4_dequant_by_hand():
    packed = torch.tensor([[0x21, 0xB7]], dtype=torch.uint8)     # codes 1,2 | 7,-3 (0xB = sign + 3)
    scale = torch.tensor([[1.5]], dtype=torch.float8_e4m3fn)      # one block of 16 covers all 4
    got = Q.dequant_nvfp4(packed, scale, torch.tensor(2.0), block=16)
    # e2m1: code 1 = 0.5, 2 = 1.0, 7 = 6.0, 0xB = -(1.5); x 1.5 x 2
    assert got.tolist() == [[1.5, 3.0, 18.0, -4.5]]


def test_bad_nvfp4_scales_and_mixed_formats_are_named(tmp_path):
    ck = tmp_path / "bad"
    save_checkpoint(W, ck)
    first = next(n for n in W.tensors if is_routed_expert(n))

    def wrong_dtype(n, e):
        if n == first:
            key = n[: -len(".weight")] + ".weight_scale"
            e[key] = e[key].float()
        return e
    rewrite_shards(ck, to_nvfp4(W.tensors, edit=wrong_dtype))
    with pytest.raises(CheckpointError, match=r"wrong dtype: .*experts\.0\.w1\.weight_scale: expected F8_E4M3, found F32"):
        scan_checkpoint(ck)

    ck2 = tmp_path / "mixed"
    save_checkpoint(W, ck2)
    dense_names = {n for n, v in W.tensors.items() if v.dtype == torch.bfloat16 and
                   (is_routed_expert(n) or ".attn.w" in n)}
    keep_packed = sorted(dense_names)[:3]

    def fn2(n, t):
        if n.endswith(".scale"):
            w = n[: -len(".scale")] + ".weight"
            return {n: t} if w in keep_packed else {}
        if n in dense_names and n not in keep_packed:
            return {n: W.tensors[n].float()}
        return {n: t}
    rewrite_shards(ck2, fn2)
    with pytest.raises(CheckpointError, match="mixed formats"):
        scan_checkpoint(ck2)


def test_inspect_names_the_layout(tmp_path, capsys):
    from fidelity.cli import main
    ck = tmp_path / "dense"
    save_checkpoint(W, ck)
    rewrite_shards(ck, to_dense(W.tensors))
    assert main(["inspect", str(ck)]) == 0
    assert "layout:     native-dense (F32)" in capsys.readouterr().out


def test_inexact_nvfp4_cast_gives_the_expected_difference(tmp_path, golden):
    """A global scale that is not a power of two: the loaded experts are exactly
    e2m1 x e4m3 x global (computed here in fp64), so the logits are those of a model holding
    those values, and differ from the original's."""
    ck = tmp_path / "inexact"
    save_checkpoint(W, ck)
    g = 0.75
    expected = dict(W.tensors)

    def record(n, e):
        base = n[: -len(".weight")]
        codes = Q.unpack_fp4(e[n]).double()
        expected[n] = (codes * e[base + ".weight_scale"].double().repeat_interleave(16, -1) * g).float()
        return e
    rewrite_shards(ck, to_nvfp4(W.tensors, g, record))
    from reference_model.weights import InMemoryWeights
    got = Model(load_checkpoint(ck), Numerics("reference")).prefill_logits(TOKENS)
    want = Model(InMemoryWeights(W.cfg, expected), Numerics("reference")).prefill_logits(TOKENS)
    assert torch.equal(got, want) and not torch.equal(got, golden)
