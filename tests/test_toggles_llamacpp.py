"""llama.cpp's CPU numerics as toggles (kernel_toggles: expert_act_q8_0, kv_cache_ggml and its
one-query decode attention, bf16_gemm_input, router_softplus_logf),
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


@pytest.mark.parametrize("kind", ["type=f16", "type=q8_0,rotate=false"])
def test_kv_cache_ggml_rounds_every_cached_row_and_nothing_else(kind):
    """Unrotated, every cached row is stored in the cache type where it is written."""
    nx = ToggleSet.parse(f"kv_cache_ggml({kind})").numerics("exact")
    base = ToggleSet.parse("").numerics("exact")
    g = torch.Generator().manual_seed(2)
    nope, rope, k = torch.randn(6, 448, generator=g), torch.randn(6, 64, generator=g), torch.randn(6, 64, generator=g)
    cache = (lambda t: t.half().float()) if kind == "type=f16" else (lambda t: torch.tensor(_q8_0_numpy(t.numpy())))
    assert torch.equal(nx.kv_store(nope), cache(base.kv_store(nope)))
    assert torch.equal(nx.index_key_store(k), cache(base.index_key_store(k)))
    inv = torch.rand(32, generator=g)
    pos = torch.arange(6)
    for site in ("kv", "compressed_kv"):
        assert torch.equal(nx.rope_apply(rope, inv, pos, site), cache(base.rope_apply(rope, inv, pos, site)))
    for site in ("q", "index_q", "index_k", "output"):
        assert torch.equal(nx.rope_apply(rope, inv, pos, site), base.rope_apply(rope, inv, pos, site))


def _hadamard_numpy(n: int) -> np.ndarray:
    """Sylvester's construction by Kronecker products, normalised (H @ H = I)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h / np.sqrt(n)


def _attention_fp64(q, kv, sink, idx, scale):
    """Softmax over the selected rows with a per-head sink in the denominator, in fp64."""
    out = np.zeros(q.shape)
    for c in range(q.shape[0]):
        rows = kv[idx[c][idx[c] >= 0]]
        s = q[c] @ rows.T * scale                                   # [H, k]
        m = s.max(-1, keepdims=True)
        p = np.exp(s - m)
        out[c] = p @ rows / (p.sum(-1, keepdims=True) + np.exp(sink[:, None] - m))
    return out


@pytest.mark.parametrize("head", [128, 512])
def test_a_q8_0_cache_attends_in_llamas_rotated_basis(head):
    """-ctk q8_0: rows and query rotated by the head's Walsh-Hadamard matrix, the rows stored
    as Q8_0 and the query converted to Q8_0 for Q.K, the output rotated back; the rows are
    not rounded where they are written (they are stored rotated). Against fp64 numpy."""
    nx = ToggleSet.parse("kv_cache_ggml(type=q8_0)").numerics("exact")
    base = ToggleSet.parse("").numerics("exact")
    g = torch.Generator().manual_seed(3)
    q, kv, sink = torch.randn(5, 2, head, generator=g), torch.randn(9, head, generator=g), torch.randn(2, generator=g)
    idx = torch.tensor([[0, 1, 2, -1], [3, 4, 5, 6], [7, 8, -1, -1], [0, 8, 4, 2], [5, -1, -1, -1]])
    got = nx.sparse_attention(q, kv, sink, idx, head ** -0.5).double().numpy()
    h = _hadamard_numpy(head)
    qr = _q8_0_numpy((q.double().numpy() @ h).astype(np.float32)).astype(np.float64)
    kr = _q8_0_numpy((kv.double().numpy() @ h).astype(np.float32)).astype(np.float64)
    want = _attention_fp64(qr, kr, sink.double().numpy(), idx.numpy(), head ** -0.5) @ h
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-6)
    plain = base.sparse_attention(q, kv, sink, idx, head ** -0.5).double().numpy()
    assert np.abs(got - plain).max() > 1e-4                       # it does change the output
    nope = torch.randn(6, head - 64, generator=g)
    assert torch.equal(nx.kv_store(nope), base.kv_store(nope))


def test_attention_rotation_size_follows_llama():
    """n = 64 doubled while it divides the head twice over; no rotation off multiples of 64."""
    assert [E.attention_rotation(d).shape[0] for d in (64, 128, 192, 512, 576)] == [64, 128, 64, 512, 64]
    assert E.attention_rotation(96) is None
    np.testing.assert_allclose(E.attention_rotation(256).numpy(), _hadamard_numpy(256), atol=1e-7)


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


def _one_query_numpy(q, kv, sink, keys, scale):
    """ggml's one-query flash attention over an f16 cache, element by element in numpy
    scalars: f16 query, fp32 scores, the running P.V an f16 vector (each update fp32
    multiply-add rounded to f16), fp32 running sum, the sink after the last key."""
    H, D = q.shape
    out = np.zeros((H, D), np.float32)
    for h in range(H):
        qh = q[h].astype(np.float16).astype(np.float64)
        M, S = -np.inf, np.float32(0.0)
        acc = np.zeros(D, np.float16)
        for key in sorted(keys):
            v = kv[key].astype(np.float16)
            sc = np.float32(np.float32(qh @ v.astype(np.float64)) * np.float32(scale))
            if sc > M:
                ms, vs = np.float32(np.exp(np.float32(M - sc))) if M > -np.inf else np.float32(0.0), np.float32(1.0)
                acc = (acc.astype(np.float32) * ms).astype(np.float16)
                M = sc
            else:
                ms, vs = np.float32(1.0), np.float32(np.exp(np.float32(sc - M)))
            acc = (acc.astype(np.float64) + v.astype(np.float64) * np.float64(vs)).astype(np.float32).astype(np.float16)
            S = np.float32(S * ms + vs)
        o = acc.astype(np.float32)
        sk = np.float32(sink[h])
        if sk > M:
            ms = np.float32(np.exp(np.float32(M - sk)))
            o, S = o * ms, np.float32(S * ms + np.float32(1.0))
        else:
            S = np.float32(S + np.float32(np.exp(np.float32(sk - M))))
        out[h] = o * np.float32(1.0 / S)
    return out


def test_an_f16_cache_decodes_through_ggmls_one_query_path():
    """A decode step over an f16 cache: ggml's one-query flash attention (f16 P.V buffer,
    keys in cache order whatever order the picks come in), against a scalar numpy loop;
    prefill keeps the fp32 tiled path (the golden's math on f16 rows)."""
    nx = ToggleSet.parse("kv_cache_ggml").numerics("exact")
    base = ToggleSet.parse("").numerics("exact")
    g = torch.Generator().manual_seed(5)
    head = 64
    q = torch.randn(2, 3, head, generator=g)
    kv = torch.randn(12, head, generator=g).half().float() * 3
    sink = torch.tensor([0.5, 9.0, -2.0])                  # one sink above every score
    idx = torch.tensor([[0, 1, 2, 3, 4, 10, 7, -1], [5, 6, 7, 8, 9, 11, 2, 0]])
    got = nx.sparse_attention(q, kv, sink, idx, head ** -0.5, "decode").double().numpy()
    for r in range(2):
        keys = [int(k) for k in idx[r] if k >= 0]
        want = _one_query_numpy(q[r].numpy(), kv.numpy(), sink.numpy(), keys, head ** -0.5)
        np.testing.assert_allclose(got[r], want, rtol=2e-6, atol=1e-7)
    exact = _attention_fp64(q.double().numpy(), kv.double().numpy(), sink.double().numpy(), idx.numpy(),
                            head ** -0.5)
    assert 1e-5 < np.abs(got - exact).max() / np.abs(exact).max() < 1e-2    # f16-sized, not wrong
    prefill = nx.sparse_attention(q, kv, sink, idx, head ** -0.5, "prefill")
    assert torch.equal(prefill, base.sparse_attention(q, kv, sink, idx, head ** -0.5, "prefill"))


def _bf16_numpy(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 -> float32 by bit arithmetic: round to nearest even on the upper 16 bits."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def test_bf16_gemm_input_rounds_the_input_of_llamas_bf16_weight_gemms():
    """The router, compressor, weights_proj and head GEMMs read bf16(x) (ggml's vec_dot type
    for BF16 weights), accumulate wide; the weights and everything else are untouched, and on
    the reference profile (whose inputs are bf16 already) it changes nothing."""
    nx = ToggleSet.parse("bf16_gemm_input").numerics("exact")
    g = torch.Generator().manual_seed(3)
    x, w, w2 = torch.randn(4, 64, generator=g), torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
    xb = _bf16_numpy(x.numpy()).astype(np.float64)
    assert not np.array_equal(xb, x.numpy().astype(np.float64))          # the input does round
    want = xb @ w.numpy().astype(np.float64).T
    np.testing.assert_allclose(nx.lm_head(x, w).double().numpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(nx.bf16_linear(x, w).double().numpy(), want, rtol=1e-5, atol=1e-5)
    kv, gate = nx.compressor_proj(x, w, w2)
    np.testing.assert_allclose(kv.double().numpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gate.double().numpy(), xb @ w2.numpy().astype(np.float64).T, rtol=1e-5, atol=1e-5)
    soft = np.sqrt(np.log1p(np.exp(want)))
    np.testing.assert_allclose(nx.moe_gate(x, w, "sqrtsoftplus").double().numpy(), soft, rtol=1e-5, atol=1e-6)
    base = ToggleSet.parse("").numerics("exact")
    assert not np.allclose(base.lm_head(x, w).double().numpy(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(nx.fp8_linear(x, w), base.fp8_linear(x, w))
    ref, ref_on = ToggleSet.parse("").numerics("reference"), ToggleSet.parse("bf16_gemm_input").numerics("reference")
    xr = x.bfloat16().float()
    for k in ("lm_head", "bf16_linear", "moe_gate"):
        args = (xr, w, "sqrtsoftplus") if k == "moe_gate" else (xr, w)
        assert torch.equal(getattr(ref_on, k)(*args), getattr(ref, k)(*args)), k


def test_router_softplus_logf_is_ggmls_float32_softplus():
    """sqrt(logf(1 + expf(l))) in float32 (l above 20: l itself): hand-derived at -20 (1 + e^-20
    rounds to 1: score 0, where the reference's is 4.5e-5), 0 (sqrt(ln 2)) and 25; numpy
    float32 on random logits; other score functions untouched."""
    nx = ToggleSet.parse("router_softplus_logf").numerics("exact")
    base = ToggleSet.parse("").numerics("exact")
    eye = torch.eye(3)
    x = torch.tensor([[-20.0, 0.0, 25.0]])
    got = nx.moe_gate(x, eye, "sqrtsoftplus")[0].tolist()
    assert got[0] == 0.0 and got[2] == pytest.approx(5.0, abs=1e-6)
    assert got[1] == pytest.approx(np.sqrt(np.log(2.0)), rel=1e-6)
    assert base.moe_gate(x, eye, "sqrtsoftplus")[0, 0] == pytest.approx(np.exp(-10.0), rel=1e-3)
    g = torch.Generator().manual_seed(4)
    xs, w = torch.randn(6, 16, generator=g) * 6, torch.randn(8, 16, generator=g)
    logits = (xs.numpy().astype(np.float64) @ w.numpy().T.astype(np.float64)).astype(np.float32)
    with np.errstate(over="ignore"):
        want = np.sqrt(np.where(logits > 20, logits, np.log(np.float32(1) + np.exp(logits))))
    np.testing.assert_allclose(nx.moe_gate(xs, w, "sqrtsoftplus").numpy(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(nx.moe_gate(xs, w, "sigmoid"), base.moe_gate(xs, w, "sigmoid"))


def test_exp_gives_each_element_the_same_value_whatever_the_tensors_size():
    """ggml_one_query_attention takes every key's exp factors in one call where it took one
    [H] call per key: the same values only if torch's exp does not depend on the size (its
    vector body and scalar tail agree), checked here on this machine's build."""
    x = torch.randn(4099, generator=torch.Generator().manual_seed(9)) * 30
    whole = torch.exp(x)
    assert torch.equal(whole, torch.cat([torch.exp(x[i:i + 4]) for i in range(0, 4099, 4)]))
    assert torch.equal(whole[:300], torch.cat([torch.exp(x[i:i + 1]) for i in range(300)]))
