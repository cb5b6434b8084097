"""kv_nvfp4 (a 4-bit KV cache, FreeToken's nvfp4_ds_mla): quant.nvfp4_qdq against values
worked by hand, and the toggle's reach -- the nope dims of the KV latent only, on the NVFP4
grid of 16-element blocks."""
import torch

from kernel_toggles import ToggleSet
from kernel_toggles.profiles import launch_settings
from reference_model import Model, Numerics, random_weights, tiny
from reference_model import quant as Q
from reference_model.taps import Taps


def test_a_block_with_an_exact_scale():
    # amax 3 -> block scale 3/6 = 0.5 (an e4m3 value); x/0.5 rounded to e2m1 {0,.5,1,1.5,2,3,4,6},
    # ties to the even code (3.5 -> 4, 5 -> 4)
    x = torch.tensor([3.0, 1.3, -0.6, 0.24, 2.2, 0, 0.1, -3.0, 0.75, 1.75, 2.5, 5 / 12, 0.2, 0.3, 0.55, 1.1])
    want = [3.0, 1.5, -0.5, 0.25, 2.0, 0, 0, -3.0, 0.75, 2.0, 2.0, 0.5, 0.25, 0.25, 0.5, 1.0]
    assert Q.nvfp4_qdq(x[None]).tolist() == [want]


def test_the_block_scale_is_rounded_to_e4m3():
    # amax 1: 1/6 = 1.333 * 2^-3 -> e4m3 1.375 * 2^-3 = 0.171875; 1/0.171875 = 5.82 -> 6 -> 1.03125
    assert Q.nvfp4_qdq(torch.tensor([[1.0] + [0.0] * 15]))[0, 0].item() == 1.03125
    # amax 0.77: 0.1283 = 1.027 * 2^-3 -> 0.125; 0.77/0.125 = 6.16 saturates at 6 -> 0.75
    assert Q.nvfp4_qdq(torch.tensor([[0.77] + [0.0] * 15]))[0, 0].item() == 0.75
    assert Q.nvfp4_qdq(torch.zeros(1, 32)).abs().sum() == 0            # all-zero blocks stay zero
    # a global scale moves the block scale's range: the same grid, scaled
    x = torch.tensor([[3.0, 1.3, -0.6, 0.24] * 4])
    assert torch.equal(Q.nvfp4_qdq(x * 2 ** -10, global_scale=2 ** -10), Q.nvfp4_qdq(x) * 2 ** -10)


def test_the_toggle_moves_the_kv_latent_first_and_only_its_nope_dims():
    cfg = tiny()
    w = random_weights(cfg, 0)
    toks = torch.randint(2, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(3))

    def kv(nx):
        taps = Taps(["layers.0.attn.kv"])
        Model(w, nx).extend(toks, None, "last", taps)
        return taps["layers.0.attn.kv"]
    golden, four = kv(Numerics("reference")), kv(ToggleSet.parse("kv_nvfp4").numerics())
    r = cfg.rope_head_dim
    assert torch.equal(golden[:, -r:], four[:, -r:])                     # RoPE dims untouched
    nope = four[:, :-r]
    assert not torch.equal(golden[:, :-r], nope)
    assert torch.equal(Q.nvfp4_qdq(nope).to(nope.dtype), nope)          # already on the NVFP4 grid


def test_the_vllm_launch_names_the_dtype_and_sglang_has_none():
    arm = ToggleSet.parse("kv_nvfp4")
    v = launch_settings(arm, "vllm")
    assert v.flags[v.flags.index("--kv-cache-dtype") + 1] == "nvfp4_ds_mla" and "kv_nvfp4" in v.unconfirmed
    assert ("kv_nvfp4", "no known sglang setting turns it on") in launch_settings(arm, "sglang").unrealisable
