"""V4.1's Engram tables stay on the host (issue 25): read from a checkpoint they are private
memory maps of their own bytes in the shard, moving a layer to a device leaves them there,
only gathered rows move, and the logits equal those of dense tables bit for bit;
`fidelity plan-memory` counts them as host (mapped) memory, not device memory."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from checkpoint_util import set_byte
from reference_model import Numerics, flash
from reference_model.v41.checkpoint_format import expected_entries
from reference_model.v41.checkpoint_read import StreamingWeights, load_checkpoint, scan_checkpoint
from reference_model.v41.checkpoint_write import save_checkpoint
from reference_model.v41.config import tiny_v41, v41_flash
from reference_model.v41.model import ModelV41
from reference_model.v41.weights import EngramTable, V41Weights, random_weights

CFG = tiny_v41()
TABLE = "layers.1.engram.embed.weight"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return save_checkpoint(random_weights(CFG, 0), tmp_path_factory.mktemp("v41") / "tiny-v41",
                           max_shard_bytes=1 << 20)


def _tables(w) -> dict:
    return {k: v for k, v in w.tensors.items() if isinstance(v, EngramTable)}


def _mapped_file(ptr: int) -> str | None:
    """The file /proc/self/maps names for the mapping holding address `ptr`."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        a, b = (int(x, 16) for x in span.split("-"))
        if a <= ptr < b:
            return rest[4] if len(rest) > 4 else None
    return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_tables_are_memory_maps_of_their_shards(ckpt):
    w, info = load_checkpoint(ckpt), scan_checkpoint(ckpt)
    assert _tables(w)
    for name, t in _tables(w).items():
        shard = str((ckpt / info.tensors[name].file).resolve())
        assert _mapped_file(t.codes.data_ptr()) == shard, name
        assert _mapped_file(t.scale.data_ptr()) == shard, name


def test_logits_equal_the_dense_table_path(ckpt):
    toks = torch.randint(0, CFG.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    mapped = load_checkpoint(ckpt)
    dense = V41Weights(CFG, {k: v.dequant() if isinstance(v, EngramTable) else v
                             for k, v in mapped.tensors.items()})
    want = ModelV41(dense, Numerics("reference")).prefill_logits(toks)
    assert torch.equal(ModelV41(mapped, Numerics("reference")).prefill_logits(toks), want)
    assert torch.equal(ModelV41(StreamingWeights(ckpt), Numerics("reference")).prefill_logits(toks), want)


def test_moving_weights_leaves_the_tables_on_the_host(ckpt):
    w = load_checkpoint(ckpt)
    moved = w.to("meta")
    assert all(moved.tensors[k] is t for k, t in _tables(w).items())
    assert moved.tensors["layers.0.attn.wq_a.weight"].device.type == "meta"
    rows = w.tensors[TABLE].lookup(torch.tensor([[0, 5]]))
    assert rows.shape == (1, 2, CFG.engram_head_dim) and rows.device.type == "cpu"


def test_nan_codes_are_named_when_their_row_is_gathered(ckpt, tmp_path):
    root = Path(shutil.copytree(ckpt, tmp_path / "tiny-v41"))
    shard = set_byte(root, TABLE, (7, 3), 0x7F)                  # an e4m3 NaN code
    table = load_checkpoint(root).tensors[TABLE]          # not read whole at load
    table.lookup(torch.tensor([0, 6, 8]))
    with pytest.raises(ValueError, match=f"{TABLE} in {shard.name}: a gathered row holds e4m3 NaN"):
        table.lookup(torch.tensor([6, 7]))


def test_plan_memory_v41_flash_keeps_the_tables_off_the_devices():
    """The published V4.1-Flash config on 4 x 141 GB: the two Engram tables (94.4 GiB each)
    are host memory; with them the first, third and fourth device did not fit."""
    from fidelity.weights.plan import PassSpec, PlanDevices, plan_memory, render
    cfg = v41_flash()
    entries = expected_entries(cfg)
    tables = sum(e.nbytes for n, e in entries.items() if ".engram.embed." in n)
    plan = plan_memory(cfg, PlanDevices("cuda:0,cuda:1,cuda:2,cuda:3", "141GB"), PassSpec(8192))
    assert plan.totals["host_mapped"] == tables and round(tables / 2**30, 2) == 188.83
    assert plan.totals["weights_quantised"] + tables == sum(e.nbytes for e in entries.values())
    assert sum(d.weights for d in plan.devices) == plan.totals["weights_quantised"]
    assert plan.fits and max(d.total for d in plan.devices) < 110 * 2**30
    assert "Host, memory-mapped: Engram tables 188.83 GiB" in render(plan)
    assert "Host, memory-mapped" not in render(plan_memory(flash(), PlanDevices("cuda:0", "2000GB"),
                                                          PassSpec(8192)))
