"""The RoPE toggles' tables and rotations (kernel_toggles/rope.py) against computations
written here: YaRN frequencies in plain Python floats (docs/research/dsv4-architecture.md §4.6), transformers' bf16
cos/sin table with the pair rotation in fp64 Python floats."""
import math

import numpy as np
import torch

import kernel_toggles as K
from kernel_util import F64, bf, bf16_round
from reference_model import Numerics, tiny


def arm(text):
    return K.ToggleSet.parse(text).numerics("reference")


def gold():
    return Numerics("reference")


def yarn_by_hand(dim, base, factor, orig, beta_fast, beta_slow):
    """docs/research/dsv4-architecture.md §4.6, in plain Python floats."""
    freqs = [base ** (-(2 * i) / dim) for i in range(dim // 2)]

    def cd(r):
        return dim * math.log(orig / (r * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(cd(beta_fast)), 0)
    high = min(math.ceil(cd(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i, f in enumerate(freqs):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        smooth = 1 - ramp
        out.append(f / factor * (1 - smooth) + f * smooth)
    return torch.tensor(out, dtype=F64)


def test_yarn_on_swa_layers_table():
    cfg = tiny()
    g, a = gold(), arm("yarn_on_swa_layers")
    got = a.rope_inv_freq(cfg, 0).to(F64)
    want = yarn_by_hand(cfg.rope_head_dim, cfg.rope_theta, cfg.rope_factor, cfg.original_seq_len,
                        cfg.beta_fast, cfg.beta_slow)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    plain = torch.tensor([cfg.rope_theta ** (-(2 * i) / cfg.rope_head_dim)
                          for i in range(cfg.rope_head_dim // 2)], dtype=F64)
    assert torch.allclose(g.rope_inv_freq(cfg, 0).to(F64), plain, rtol=1e-12, atol=0)
    assert not torch.allclose(got, plain)
    assert torch.equal(a.rope_inv_freq(cfg, 4), g.rope_inv_freq(cfg, 4))   # compressed untouched
    c = arm("yarn_on_swa_layers(theta=compressed)")
    assert torch.equal(c.rope_inv_freq(cfg, 0), g.rope_inv_freq(cfg, 4))


def test_rope_table_bf16_against_an_fp64_rotation_with_bf16_cos_sin():
    """transformers' table (fp32 angles, cos/sin rounded to bf16) and the rotation of
    adjacent pairs written here in fp64 Python floats: the toggle equals it bit for bit at
    every site and both directions; the golden (fp32-or-wider table) does not."""
    cfg = tiny()
    g, a = gold(), arm("rope_table_bf16")
    inv = g.rope_inv_freq(cfg, 4)                      # compressed-layer table (YaRN)
    pos = torch.tensor([0, 1, 7, 100, 5000, 65535])
    x = bf(torch.randn(len(pos), 2, cfg.head_dim, generator=torch.Generator().manual_seed(5)))
    r = cfg.rope_head_dim
    f32 = np.float32
    for inverse in (False, True):
        want = x.clone()
        for n, t in enumerate(pos.tolist()):
            for i, f in enumerate(inv.tolist()):
                ang = float(f32(t) * f32(f))               # fp32 angle, as transformers
                c, s = bf16_round(math.cos(ang)), bf16_round(math.sin(ang))
                s = -s if inverse else s
                for h in range(2):
                    x0, x1 = x[n, h, -r + 2 * i].item(), x[n, h, -r + 2 * i + 1].item()
                    want[n, h, -r + 2 * i] = x0 * c - x1 * s
                    want[n, h, -r + 2 * i + 1] = x0 * s + x1 * c
        got = a.rope_apply(x, inv, pos, "q", inverse)
        assert torch.equal(got.to(F64), bf(want))
        assert torch.equal(got[0], g.rope_apply(x, inv, pos, "q", inverse)[0])   # t = 0: cos 1, sin 0
        assert not torch.equal(got, g.rope_apply(x, inv, pos, "q", inverse))
    for site in ("kv", "compressed_kv", "index_q", "index_k", "output"):
        assert torch.equal(a.rope_apply(x, inv, pos, site), a.rope_apply(x, inv, pos, "q"))


