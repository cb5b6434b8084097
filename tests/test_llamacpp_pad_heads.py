"""Widening the embedded model's heads for llama.cpp (fidelity/llamacpp/pad_heads.py) keeps
the function bit for bit under the golden: the same log-probs at every position and the same
greedy continuation, computed independently on both checkpoints."""
import json

import numpy as np
import pytest
import torch

from fidelity.scores.dialects import Request
from fidelity.scores.inprocess import InProcessScorer
from fidelity.llamacpp.pad_heads import PadError, block_map, dim_map, pad_checkpoint
from fidelity.pipeline.model import arm_numerics
from fidelity.design.prompts import builtin_prompts
from fidelity.weights.source import load_tokenizer_for, load_weights

SRC = "models/tiny-needle-v2"


def test_dim_map_by_hand():
    # one head of 4 dims (2 RoPE) widened to 8: no-RoPE dims first, zeros, RoPE dims last
    assert dim_map(1, 4, 8, 2).tolist() == [0, 1, -1, -1, -1, -1, 2, 3]
    assert dim_map(2, 4, 8, 2).tolist() == [0, 1, -1, -1, -1, -1, 2, 3, 4, 5, -1, -1, -1, -1, 6, 7]


def test_block_map_refuses_a_block_from_two_sources():
    assert block_map(dim_map(1, 128, 512, 64)).tolist() == [0, -1, -1, 0]
    with pytest.raises(PadError, match="mixes"):
        block_map(torch.arange(64, 192))


@pytest.fixture(scope="module")
def widened(tmp_path_factory):
    return pad_checkpoint(SRC, tmp_path_factory.mktemp("pad") / "wide", 512)


def test_same_function_bit_for_bit(widened):
    assert json.loads((widened / "config.json").read_text())["head_dim"] == 512
    tok = load_tokenizer_for(SRC)
    w0, _ = load_weights(SRC)
    w1, _ = load_weights(str(widened))
    nx = arm_numerics("golden", "reference", {}, "v4")
    for p in builtin_prompts(w0.cfg, (300,), 2, 0, tok):         # past one 128-token compression
        ids = p.tokens.tolist()
        a = InProcessScorer("a", nx, w0).score(ids, Request(k=1, steps=3))
        b = InProcessScorer("b", nx, w1).score(ids, Request(k=1, steps=3))
        assert all(np.array_equal(x.logp, y.logp) for x, y in zip(a.known, b.known))
        assert a.ladder_tokens == b.ladder_tokens


def test_fp8_weights_are_not_requantised(widened):
    w0, _ = load_weights(SRC)
    w1, _ = load_weights(str(widened))
    old = w0.layer_weights(1)["attn.wkv.weight"].float()
    new = w1.layer_weights(1)["attn.wkv.weight"].float()
    m = dim_map(1, 128, 512, 64)
    assert torch.equal(new[m >= 0], 2 * old[m[m >= 0]])             # doubled exactly (scale exponent + 1)
    assert not new[m < 0].any()


def test_a_factor_without_exact_rescales_is_refused(tmp_path):
    with pytest.raises(PadError, match="4, 16"):
        pad_checkpoint(SRC, tmp_path / "x", 256)


def test_the_mtp_layer_is_widened_to_the_same_function(widened):
    """The MTP layer's attention is widened like a main layer's: its logits are the same."""
    from reference_model import Model
    from reference_model.mtp import MTP, load_mtp_weights
    ids = torch.randint(2, 500, (80,), generator=torch.Generator().manual_seed(0))
    out = []
    for path in (SRC, widened):
        m = Model(load_weights(str(path))[0])
        H = m.extend(ids[:-1], None, "hidden")[0]
        mtp = MTP(m, load_mtp_weights(path))
        out.append(mtp.forward(H, ids[1:], mtp.new_state(), "all")[0])
    assert json.loads((widened / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert torch.equal(out[0], out[1])
