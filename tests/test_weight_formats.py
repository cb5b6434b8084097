"""Checkpoint layouts beyond DeepSeek's FP8/FP4 release (docs/weight-formats.md): native
names with the quantised tensors stored dequantised (bf16 / fp32, no scales) and NVIDIA
ModelOpt NVFP4 routed experts. Fixtures are written here from the tiny model; values that
are identical load to bit-identical logits; NVFP4 dequantisation checked by hand; bad
scales and mixed formats named."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from reference_model import Model, Numerics, tiny
from reference_model import quant as Q
from reference_model.checkpoint import (CheckpointError, StreamingWeights, load_checkpoint, save_checkpoint,
                                        scan_checkpoint)
from reference_model.checkpoint_format import INDEX_NAME, is_routed_expert
from reference_model.resident import QuantisedResidentWeights
from reference_model.weights import random_weights

W = random_weights(tiny(), seed=6)
TOKENS = torch.randint(2, 500, (120,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def golden():
    return Model(W, Numerics("reference")).prefill_logits(TOKENS)


def _rewrite(ck, fn):
    """Apply fn(name, tensor) -> {name: tensor} to every tensor of every shard; rebuild the index."""
    wm = {}
    for shard in sorted(ck.glob("*.safetensors")):
        out = {}
        for n, t in load_file(shard).items():
            out.update(fn(n, t))
        save_file(out, shard)
        wm.update({n: shard.name for n in out})
    (ck / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": wm}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_dense_loads_bit_identical(tmp_path, golden, dtype):
    ck = tmp_path / "dense"
    save_checkpoint(W, ck)
    # the quantised (and bf16) tensors as `dtype`; fp32 tensors (norms, mHC, sinks) stay fp32
    dense = {k: v.to(dtype) if v.dtype == torch.bfloat16 else v for k, v in W.tensors.items()}

    def fn(n, t):
        if n.endswith(".scale"):
            return {}                                  # no scales in a dequantised conversion
        return {n: dense[n]} if n in dense else {n: t}
    _rewrite(ck, fn)
    info = scan_checkpoint(ck)
    assert info.layout == "native-dense" and any("native-dense" in x for x in info.notes)
    for src in (load_checkpoint(ck), StreamingWeights(ck), QuantisedResidentWeights(ck)):
        assert torch.equal(Model(src, Numerics("reference")).prefill_logits(TOKENS), golden)


def _nvfp4(values: torch.Tensor):
    """An exactly representable NVFP4 cast of FP4-grid values (e2m1 x 2^k per 32): the same
    codes, the power-of-two block scale per 16 as e4m3, a global scale of 1."""
    codes_vals, s32 = Q.quantize_fp4_weight(values.float())
    packed = Q.pack_fp4(codes_vals).view(torch.uint8)
    s16 = s32.repeat_interleave(2, -1).to(torch.float8_e4m3fn)
    assert torch.equal(s16.float(), s32.repeat_interleave(2, -1))        # exact in e4m3
    return packed, s16, torch.tensor(1.0), torch.tensor(0.5)


def test_nvfp4_experts_load_bit_identical(tmp_path, golden):
    ck = tmp_path / "nvfp4"
    save_checkpoint(W, ck)

    def fn(n, t):
        if n.endswith(".scale") and is_routed_expert(n[: -len(".scale")] + ".weight"):
            return {}
        if is_routed_expert(n):
            p, s16, g, inp = _nvfp4(W.tensors[n])
            base = n[: -len(".weight")]
            return {n: p, base + ".weight_scale": s16, base + ".weight_scale_2": g, base + ".input_scale": inp}
        return {n: t}
    _rewrite(ck, fn)
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

    def fn(n, t):
        if n.endswith(".scale") and is_routed_expert(n[: -len(".scale")] + ".weight"):
            return {}
        if is_routed_expert(n):
            p, s16, g, inp = _nvfp4(W.tensors[n])
            base = n[: -len(".weight")]
            if n == first:
                s16 = s16.float()                                  # wrong dtype
            return {n: p, base + ".weight_scale": s16, base + ".weight_scale_2": g, base + ".input_scale": inp}
        return {n: t}
    _rewrite(ck, fn)
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
    _rewrite(ck2, fn2)
    with pytest.raises(CheckpointError, match="mixed formats"):
        scan_checkpoint(ck2)


def test_inspect_names_the_layout(tmp_path, capsys):
    from fidelity.cli import main
    ck = tmp_path / "dense"
    save_checkpoint(W, ck)
    _rewrite(ck, lambda n, t: {} if n.endswith(".scale") else {n: W.tensors[n].float()
                                                               if W.tensors[n].dtype == torch.bfloat16 else t})
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

    def fn(n, t):
        if n.endswith(".scale") and is_routed_expert(n[: -len(".scale")] + ".weight"):
            return {}
        if is_routed_expert(n):
            p, s16, _, inp = _nvfp4(W.tensors[n])
            codes = Q.unpack_fp4(p).double()
            expected[n] = (codes * s16.double().repeat_interleave(16, -1) * g).float()
            base = n[: -len(".weight")]
            return {n: p, base + ".weight_scale": s16, base + ".weight_scale_2": torch.tensor(g),
                    base + ".input_scale": inp}
        return {n: t}
    _rewrite(ck, fn)
    from reference_model.weights import InMemoryWeights
    got = Model(load_checkpoint(ck), Numerics("reference")).prefill_logits(TOKENS)
    want = Model(InMemoryWeights(W.cfg, expected), Numerics("reference")).prefill_logits(TOKENS)
    assert torch.equal(got, want) and not torch.equal(got, golden)
