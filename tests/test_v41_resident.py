"""Quantised-resident DeepSeek-V4.1 weights (issue 25): the checkpoint's own tensors (32x32
FP8 blocks, FP4 experts) resident and dequantised on use give logits bit-identical to the
dense and streamed loads (also placed over two devices); the Engram tables are not copied
anywhere (host memory maps), only routed experts are decoded, bad data is named."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from checkpoint_util import set_byte
from fidelity.weights.source import load_weights
from reference_model import Numerics
from reference_model.checkpoint_format import CheckpointError
from reference_model.v41.checkpoint_read import StreamingWeights, load_checkpoint
from reference_model.v41.checkpoint_write import save_checkpoint
from reference_model.v41.config import tiny_v41
from reference_model.v41.model import ModelV41
from reference_model.v41.resident import V41QuantisedResidentWeights
from reference_model.v41.specs import FP4
from reference_model.v41.weights import EngramTable, random_weights

CFG = tiny_v41()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return save_checkpoint(random_weights(CFG, 2), tmp_path_factory.mktemp("v41") / "tiny-v41",
                           max_shard_bytes=1 << 20)


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("devices", [None, ["cpu", "cpu"]])
def test_bit_identical_to_dense_and_streamed(ckpt, devices):
    t = _tokens(60)
    dense = ModelV41(load_checkpoint(ckpt), Numerics("reference")).prefill_logits(t)
    streamed = ModelV41(StreamingWeights(ckpt), Numerics("reference")).prefill_logits(t)
    rq = V41QuantisedResidentWeights(ckpt, devices=devices)
    res = ModelV41(rq, Numerics("reference"), devices=devices).prefill_logits(t)
    assert torch.equal(dense, streamed) and torch.equal(dense, res)


def test_resident_bytes_leave_out_the_host_mapped_tables(ckpt):
    rq = V41QuantisedResidentWeights(ckpt)
    tables = sum(h.nbytes for n, h in rq.info.tensors.items() if ".engram.embed." in n)
    assert tables > 0
    assert rq.resident_bytes == sum(h.nbytes for h in rq.info.tensors.values()) - tables
    table = rq.layer_weights(CFG.engram_layer_ids[0])["engram.embed.weight"]
    assert isinstance(table, EngramTable) and table.to("meta") is table


def test_only_routed_experts_are_decoded(ckpt):
    rq = V41QuantisedResidentWeights(ckpt)
    m = ModelV41(rq, Numerics("reference"))
    _, st = m.extend(_tokens(30), None, "last")
    rq.decoded.clear()
    m.extend(torch.tensor([7]), st, "last")              # one token: top-k experts per layer
    routed = CFG.n_layers * CFG.n_activated_experts * 3
    assert 0 < rq.decoded.get(FP4, 0) <= routed < CFG.n_layers * CFG.n_routed_experts * 3


def test_load_weights_names_the_mode(ckpt):
    w, label = load_weights(str(ckpt), mode="resident-quantised")
    assert isinstance(w, V41QuantisedResidentWeights) and label.endswith("(resident-quantised)")


def test_bad_data_is_named_at_load(ckpt, tmp_path):
    root = Path(shutil.copytree(ckpt, tmp_path / "tiny-v41"))
    n = "layers.2.attn.wq_a.scale"
    shard = set_byte(root, n, (0, 0), 255)                       # an E8M0 NaN byte
    with pytest.raises(CheckpointError, match=f"bad data: {n} in {shard.name}: .*E8M0 NaN byte 255"):
        V41QuantisedResidentWeights(root)
