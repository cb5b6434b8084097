"""V4.1's Engram kernels (reference_model/v41/kernels.py) against the doc's hand-check values
(docs/v41-architecture.md §12) and formulations written here from §5.2: hashing (with a
pure-Python reimplementation on sympy primes and numpy multipliers), history compression,
table lookup and the gate (other V4.1 kernels: test_v41_kernels.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import sympy
import torch

from kernel_util import EXACT, REF, gen as _g, is_bf16 as _is_bf16
from reference_model import quant as Q
from reference_model.v41 import kernels as K
from reference_model.v41.config import tiny_v41, v41_flash
from reference_model.v41.engram import engram_layout
from reference_model.v41.weights import encode_rows


# ---- Engram hash --------------------------------------------------------------------------
def test_hash_release_hand_check_values_doc_section_12():
    L = engram_layout(v41_flash())
    ids = K.engram_hash(torch.tensor([1000, 2000, 3000, 4000]), torch.arange(4), L, pad_c=2)
    assert ids.shape == (4, 2, 24) and ids.dtype == torch.long
    assert ids[:, 0, [0, 8, 16]].tolist() == [[3617660, 143733824, 264290285],
                                              [1677522, 137125844, 270865324],
                                              [4092044, 128488902, 257885886],
                                              [15465977, 130437439, 261497777]]
    assert ids[:, 1, 0].tolist() == [12603780, 1525027, 3263753, 531236]


def test_hash_tiny_hand_check_values_with_a_dead_token():
    L = engram_layout(tiny_v41())
    ids = K.engram_hash(torch.tensor([10, 20, 30, 40]), torch.arange(4), L, pad_c=1)
    assert ids[0].tolist() == [[43, 74, 164, 223, 363, 385], [11, 159, 283, 395, 430, 549]]
    assert ids[3].tolist() == [[20, 103, 167, 283, 344, 394], [67, 160, 265, 306, 439, 562]]
    dead = K.engram_hash(torch.tensor([10, 20, K.DEAD, 40, 50]), torch.arange(5), L, pad_c=1)
    assert torch.equal(dead[:2], ids[:2])                       # before the DEAD token: unchanged
    assert dead[2, 0].tolist() == [10, 87, 156, 239, 294, 419]  # pad-only n-grams
    assert dead[3, 0].tolist() == [36, 118, 172, 233, 360, 418]  # blocked from its first look-back
    assert dead[4, 0].tolist() == [50, 111, 149, 277, 339, 387]  # keeps (50, 40), pads 3-, 4-gram


def _py_hash(hist, p, layers, N, heads, start, C, pad):
    """The doc's §5.2 pseudo-code on Python ints, with primes from sympy and multipliers
    from numpy -- nothing shared with the kernel or v41/engram.py."""
    seen, primes = set(), []
    for _ in layers:
        per = []
        for _n in range(2, N + 1):
            cur, hs = start - 1, []
            for _h in range(heads):
                cur = sympy.nextprime(cur)
                while cur in seen:
                    cur = sympy.nextprime(cur)
                seen.add(cur)
                hs.append(cur)
            per.append(hs)
        primes.append(per)
    blocked, tok = False, []
    for s in range(N):
        src = hist[max(p - s, 0)]
        blocked = blocked or p < s or src == -1
        tok.append(pad if blocked else src)
    out = []
    for k, layer in enumerate(layers):
        bound = max(1, (2 ** 63 - 1) // C // 2)
        mult = [2 * int(v) + 1 for v in np.random.default_rng(10007 * layer).integers(0, bound, size=N, dtype=np.int64)]
        flat = [q for per in primes[k] for q in per]
        offs = [sum(flat[:c]) for c in range(len(flat))]
        rolling, row = tok[0] * mult[0], []
        for i in range(1, N):
            rolling ^= tok[i] * mult[i]
            for h in range(heads):
                c = (i - 1) * heads + h
                row.append(rolling % primes[k][i - 1][h] + offs[c])
        out.append(row)
    return out


@pytest.mark.parametrize("cfg", [tiny_v41, v41_flash])
def test_hash_matches_an_independent_python_implementation(cfg):
    c = cfg()
    C, pad = c.engram_compressed_vocab_size, 1 if c.engram_compressed_vocab_size == 430 else 2
    g = _g(3)
    hist = torch.randint(0, C, (40,), generator=g)
    hist[[7, 8, 20]] = K.DEAD
    hist[30] = C - 1                                    # the largest token: no int64 overflow
    L = engram_layout(c)
    ids = K.engram_hash(hist, torch.arange(40), L, pad)
    for p in range(40):
        want = _py_hash(hist.tolist(), p, c.engram_layer_ids, 4, c.engram_n_heads,
                        c.engram_vocab_size, C, pad)
        assert ids[p].tolist() == want, p
    assert bool((ids >= 0).all())
    for k, rows in enumerate(L.rows):
        assert int(ids[:, k].max()) < rows


def test_hash_of_a_decode_step_equals_prefill():
    """History by absolute position: hashing positions 30..39 alone (a later chunk or decode
    steps) gives the prefill's ids."""
    L = engram_layout(tiny_v41())
    hist = torch.randint(0, 430, (40,), generator=_g(1))
    full = K.engram_hash(hist, torch.arange(40), L, 1)
    assert torch.equal(K.engram_hash(hist, torch.arange(30, 40), L, 1), full[30:])
    assert torch.equal(K.engram_hash(hist, torch.tensor([17]), L, 1), full[17:18])


def test_compress_history_marks_dead_tokens():
    tm = [0, 1, 1, 2, 3]
    h = K.compress_history(torch.tensor([4, 2, 1, 3]), tm, torch.tensor([False, True, False, False]))
    assert h.tolist() == [3, K.DEAD, 1, 2]


# ---- Engram lookup and gate ---------------------------------------------------------------
def test_lookup_of_a_table_equals_its_dense_rows():
    dense = torch.randn(50, 64, generator=_g(2))
    tab = encode_rows(dense)
    deq = tab.dequant()
    ids = torch.tensor([[3, 49, 0], [7, 7, 1]])
    assert torch.equal(K.engram_lookup(REF, tab, ids), K.engram_lookup(REF, deq, ids))
    assert K.engram_lookup(REF, tab, ids).shape == (2, 3, 64)
    # on the grid: every 32-block is e4m3 values times one power of two, within 1/16 relative
    assert torch.allclose(deq.float(), dense, rtol=1 / 16, atol=2 ** -6 * dense.abs().amax())


def _gate_inputs(s=3, hc=4, d=16, seed=0):
    g = _g(seed)
    H = torch.randn(s, hc, d, generator=g, dtype=torch.float64)
    kv = torch.randn(s, (hc + 1) * d, generator=g, dtype=torch.float64)
    qw = 1 + 0.1 * torch.randn(hc, d, generator=g, dtype=torch.float64)
    kw = 1 + 0.1 * torch.randn(hc, d, generator=g, dtype=torch.float64)
    return H, kv, qw, kw


def test_gate_closed_form():
    """key_k = X_k, w = 1: dot = Σ X²/mean(X²)·d^-½ = sqrt(d) = 4 for d = 16, g = sigmoid(2);
    key = -X: g = sigmoid(-2); key = 0 (dot 0): g = sigmoid(0) = 1/2."""
    s, hc, d = 3, 4, 16
    H = torch.randn(s, hc, d, generator=_g(5), dtype=torch.float64)
    value = torch.randn(s, d, generator=_g(6), dtype=torch.float64)
    ones = torch.ones(hc, d, dtype=torch.float64)
    key = torch.stack([H[0], -H[1], torch.zeros(hc, d, dtype=torch.float64)])
    kv = torch.cat([key.flatten(1), value], 1)
    out = K.engram_gate(EXACT, H, kv, ones, ones, 1e-20)
    for t, gv in enumerate([1 / (1 + math.exp(-2)), 1 / (1 + math.exp(2)), 0.5]):
        assert torch.allclose(out[t], H[t] + gv * value[t], rtol=0, atol=1e-12), t


def test_gate_matches_an_independent_formulation():
    H, kv, qw, kw = _gate_inputs()
    s, hc, d = H.shape
    out = K.engram_gate(EXACT, H, kv, qw, kw, 1e-20)
    want = torch.empty_like(H)
    for t in range(s):
        value = kv[t, hc * d:]
        for k in range(hc):
            x, key = H[t, k].tolist(), kv[t, k * d:(k + 1) * d].tolist()
            rx = 1 / math.sqrt(sum(v * v for v in x) / d + 1e-20)
            rk = 1 / math.sqrt(sum(v * v for v in key) / d + 1e-20)
            dot = sum(x[i] * qw[k, i].item() * kw[k, i].item() * key[i] for i in range(d)) * rx * rk / math.sqrt(d)
            gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
            want[t, k] = H[t, k] + gate * value
    assert torch.allclose(out, want, rtol=0, atol=1e-12)


def test_gate_reference_profile_and_token_mask():
    H, kv, qw, kw = _gate_inputs(seed=1)
    Hb = REF.rs(H)
    out = K.engram_gate(REF, Hb, REF.rs(kv), qw, kw, 1e-20)
    assert _is_bf16(out) and not torch.equal(out, Hb)
    masked = K.engram_gate(REF, Hb, REF.rs(kv), qw, kw, 1e-20, token_mask=torch.tensor([True, False, True]))
    assert torch.equal(masked[1], Hb[1]) and torch.equal(masked[0], out[0])


def test_engram_layer_composes_lookup_wkv_and_gate():
    c = tiny_v41()
    hc, d, cols, hd = 4, 32, 6, 32
    g = _g(8)
    tab = encode_rows(torch.randn(462, hd, generator=g))
    wkv = torch.randn((hc + 1) * d, cols * hd, generator=g) / 14
    ids = torch.randint(0, 462, (5, cols), generator=g)
    H = REF.rs(torch.randn(5, hc, d, generator=g, dtype=torch.float64))
    qw, kw = torch.ones(hc, d), torch.ones(hc, d)
    out = K.engram(REF, H, ids, tab, wkv, qw, kw, c.norm_eps)
    rows = tab.dequant()[ids].double().flatten(1)                 # bf16 rows
    kv = REF.rs(Q.fp8_qdq(rows, 32).double() @ wkv.double().T)    # act quant 1x32, bf16 out
    assert torch.equal(out, K.engram_gate(REF, H, kv, qw, kw, c.norm_eps))


