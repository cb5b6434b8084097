"""llama.cpp's CPU numerics as toggles (kernel_toggles: expert_act_q8_0, kv_cache_ggml),
checked against hand-derived values and an independent numpy computation. The real engine
check is tests/test_llama_cpp.py's replay (its MoE reproduced to float32 rounding)."""
import numpy as np
import pytest
import torch

from kernel_toggles import emulate as E
from kernel_toggles.arms import ToggleSet


def _q8_0_numpy(x: np.ndarray) -> np.ndarray:
    """Q8_0 as ggml's x86 quantize_row_q8_0 writes it, in numpy: per 32 values, codes
    rint(x * (127 / amax)) (ties to even) in float32, scale float16(amax / 127)."""
    x = x.astype(np.float32)
    b = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(b).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    codes = np.rint(b * inv)
    d = (amax / np.float32(127.0)).astype(np.float16).astype(np.float32)
    return (codes * d).reshape(x.shape)


def test_q8_0_by_hand():
    x = torch.zeros(1, 32)
    x[0, :2] = torch.tensor([0.5, -1.0])
    # amax 1: 0.5 * 127 = 63.5 -> 64 (ties to even); scale fp16(1/127) = 1032 / 2^17
    d = 1032 / 2 ** 17
    assert E.q8_0(x)[0, :3].tolist() == [64 * d, -127 * d, 0.0]
    y = torch.zeros(1, 32)
    y[0, :3] = torch.tensor([127.0, 2.5, -3.5])          # amax 127: scale 1, codes 127, 2, -4
    assert E.q8_0(y)[0, :3].tolist() == [127.0, 2.0, -4.0]
    assert E.q8_0(torch.zeros(2, 64)).abs().sum() == 0
    with pytest.raises(ValueError, match="multiple of 32"):
        E.q8_0(torch.ones(1, 48))


def test_q8_0_matches_numpy_on_random_rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 256, generator=g) * torch.logspace(-3, 2, 16).unsqueeze(1)
    assert np.array_equal(E.q8_0(x).numpy(), _q8_0_numpy(x.numpy()))


def test_expert_act_q8_0_is_llamas_routed_expert():
    """Q8_0 of the input before gate/up, SwiGLU (clamped), Q8_0 before down, the routing
    weight on the output; shared experts (weight None) untouched."""
    nx = ToggleSet.parse("expert_act_q8_0").numerics("exact")
    base = ToggleSet.parse("").numerics("exact")
    g = torch.Generator().manual_seed(1)
    x, w1, w3, w2 = (torch.randn(*s, generator=g) for s in ((5, 64), (32, 64), (32, 64), (64, 32)))
    weight = torch.tensor([0.5, 1.0, 2.0, 0.25, 1.5])
    got = nx.expert_ffn(x, w1, w3, w2, weight, 7.0).numpy()
    a = _q8_0_numpy(x.numpy()).astype(np.float64)
    gate, up = a @ w1.numpy().T.astype(np.float64), a @ w3.numpy().T.astype(np.float64)
    gate, up = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
    h = gate / (1 + np.exp(-gate)) * up
    want = (_q8_0_numpy(h.astype(np.float32)).astype(np.float64) @ w2.numpy().T) * weight.numpy()[:, None]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)
    assert torch.equal(nx.expert_ffn(x, w1, w3, w2, None, 7.0), base.expert_ffn(x, w1, w3, w2, None, 7.0))


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_kv_cache_ggml_rounds_every_cached_row_and_nothing_else(kind):
    nx = ToggleSet.parse(f"kv_cache_ggml(type={kind})").numerics("exact")
    base = ToggleSet.parse("").numerics("exact")
    g = torch.Generator().manual_seed(2)
    nope, rope, k = torch.randn(6, 448, generator=g), torch.randn(6, 64, generator=g), torch.randn(6, 64, generator=g)
    cache = (lambda t: t.half().float()) if kind == "f16" else (lambda t: torch.tensor(_q8_0_numpy(t.numpy())))
    assert torch.equal(nx.kv_store(nope), cache(base.kv_store(nope)))
    assert torch.equal(nx.index_key_store(k), cache(base.index_key_store(k)))
    inv = torch.rand(32, generator=g)
    pos = torch.arange(6)
    for site in ("kv", "compressed_kv"):
        assert torch.equal(nx.rope_apply(rope, inv, pos, site), cache(base.rope_apply(rope, inv, pos, site)))
    for site in ("q", "index_q", "index_k", "output"):
        assert torch.equal(nx.rope_apply(rope, inv, pos, site), base.rope_apply(rope, inv, pos, site))


def test_an_f16_cache_holds_the_references_values_exactly_and_rounds_the_exact_profiles():
    """The reference stores bf16 and an FP8 grid, which f16 holds exactly: kv_cache_ggml's
    default is a no-op there. On the exact profile (fp32 values, llama.cpp's) it rounds the
    cached rows, so the first tap to differ is layer 0's KV."""
    from reference_model import Model, Numerics, Taps, random_weights, tiny
    w = random_weights(tiny(), 0)
    tokens = torch.randint(0, tiny().vocab_size, (64,), generator=torch.Generator().manual_seed(1))

    def taps(nx):
        t = Taps("*")
        Model(w, nx).extend(tokens, None, "all", t)
        return t
    ref, cached = taps(Numerics("reference")), taps(ToggleSet.parse("kv_cache_ggml").numerics())
    assert all(torch.equal(ref[n], cached[n]) for n in ref.names())
    ex, ex_cached = taps(Numerics("exact")), taps(ToggleSet.parse("kv_cache_ggml").numerics("exact"))
    first = next(n for n in ex.names() if not torch.equal(ex[n], ex_cached[n]))
    assert first == "layers.0.attn.kv"
