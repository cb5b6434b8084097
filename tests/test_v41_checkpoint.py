"""DeepSeek-V4.1 checkpoints (docs/v41-architecture.md §6, §11): the tensor table for the
release and the tiny config, a random-weight tiny V4.1 checkpoint written in native names
and read back bit for bit, named errors for bad files (missing, wrong shape or dtype,
128-block scales, Engram rows, V4 <-> V4.1 mislabelling), draft/vision tensors skipped,
and `fidelity inspect` / `fidelity plan-memory` on V4.1."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fidelity import cli
from reference_model import random_weights as v4_random_weights, tiny
from reference_model.checkpoint import CheckpointError, save_checkpoint as v4_save, scan_checkpoint as v4_scan
from reference_model.checkpoint_write import hf_config_dict as v4_config_dict
from reference_model.v41.checkpoint_format import expected_entries
from reference_model.v41.checkpoint_read import is_v41_checkpoint, load_checkpoint, scan_checkpoint
from reference_model.v41.checkpoint_write import hf_config_dict, save_checkpoint
from reference_model.v41.config import tiny_v41, v41_flash
from reference_model.v41.weights import EngramTable, random_weights

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def tiny_w():
    return random_weights(tiny_v41(), seed=5)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tiny_w):
    return save_checkpoint(tiny_w, tmp_path_factory.mktemp("v41") / "tiny-v41", max_shard_bytes=1 << 20)


@pytest.fixture
def ck(pristine, tmp_path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "tiny-v41"))


def _edit(root: Path, name: str, fn):
    """fn(dict of the shard holding `name`); rewrite that shard and the index."""
    idx = json.loads((root / INDEX).read_text())
    f = idx["weight_map"][name]
    d = load_file(root / f)
    fn(d)
    save_file(d, str(root / f))
    wm = {k: v for k, v in idx["weight_map"].items() if v != f}
    wm.update({k: f for k in d})
    idx["weight_map"] = wm
    (root / INDEX).write_text(json.dumps(idx))


def _problems(root, **kw) -> list[str]:
    with pytest.raises(CheckpointError) as ei:
        scan_checkpoint(root, **kw)
    return ei.value.problems


# ---- the table ----------------------------------------------------------------------------
def test_release_table_spot_shapes_doc_section_6():
    e = expected_entries(v41_flash())
    want = {
        "layers.0.attn.wq_a.weight": ("F8_E4M3", (1280, 5120)),
        "layers.0.attn.wq_a.scale": ("F8_E8M0", (40, 160)),
        "layers.0.attn.wq_b.scale": ("F8_E8M0", (1024, 40)),
        "layers.0.attn.wkv.scale": ("F8_E8M0", (16, 160)),
        "layers.0.attn.wo_a.weight": ("F8_E4M3", (8192, 4096)),
        "layers.0.attn.wo_a.scale": ("F8_E8M0", (256, 128)),
        "layers.0.attn.wo_b.scale": ("F8_E8M0", (160, 256)),
        "layers.0.hc_attn_fn": ("F32", (24, 20480)),
        "layers.2.attn.compressor.wkv.weight": ("BF16", (512, 5120)),
        "layers.2.attn.compressor.wgate.weight": ("BF16", (512, 5120)),
        "layers.20.attn.compressor.norm.weight": ("BF16", (512,)),
        "layers.2.attn.indexer.wk.weight": ("BF16", (128, 512)),
        "layers.24.attn.indexer.wq_b.weight": ("F8_E4M3", (4096, 1280)),
        "layers.24.attn.indexer.wq_b.scale": ("F8_E8M0", (128, 40)),
        "layers.24.attn.indexer.weights_proj.weight": ("BF16", (32, 5120)),
        "layers.5.ffn.gate.bias_vl": ("F32", (384,)),
        "layers.5.ffn.experts.383.w1.weight": ("I8", (2304, 2560)),
        "layers.5.ffn.experts.383.w1.scale": ("F8_E8M0", (2304, 160)),
        "layers.5.ffn.experts.0.w2.weight": ("I8", (5120, 1152)),
        "layers.5.ffn.experts.0.w2.scale": ("F8_E8M0", (5120, 72)),
        "layers.5.ffn.shared_experts.w1.scale": ("F8_E8M0", (72, 160)),
        "layers.5.ffn.shared_experts.w2.scale": ("F8_E8M0", (160, 72)),
        "layers.1.engram.embed.weight": ("F8_E4M3", (384006168, 256)),
        "layers.1.engram.embed.scale": ("F8_E8M0", (384006168, 8)),
        "layers.14.engram.embed.weight": ("F8_E4M3", (384016682, 256)),
        "layers.14.engram.wkv.weight": ("F8_E4M3", (25600, 6144)),
        "layers.14.engram.wkv.scale": ("F8_E8M0", (800, 192)),
        "layers.14.engram.q_weight": ("BF16", (4, 5120)),
        "head.weight": ("BF16", (129280, 5120)),
    }
    for n, (dt, shape) in want.items():
        assert (e[n].dtype, e[n].shape) == (dt, shape), n
    absent = ["hc_head_fn", "layers.2.attn.compressor.ape", "layers.20.attn.compressor.wgate.weight",
              "layers.3.attn.compressor.wkv.weight", "layers.24.attn.indexer.wk.weight",
              "layers.3.attn.indexer.wq_b.weight", "layers.0.ffn.gate.tid2eid",
              "layers.2.engram.embed.weight", "layers.2.attn.indexer.compressor.wkv.weight"]
    assert not [n for n in absent if n in e]
    # Engram tables ~91.6 GiB each + ~2.9 GiB scales (doc §6)
    assert abs(e["layers.1.engram.embed.weight"].nbytes / 2 ** 30 - 91.6) < 0.1
    assert abs(e["layers.1.engram.embed.scale"].nbytes / 2 ** 30 - 2.9) < 0.1


def test_tiny_table_doc_section_10():
    e = expected_entries(tiny_v41())
    assert (e["layers.4.engram.wkv.weight"].shape, e["layers.4.engram.wkv.scale"].shape) == ((1280, 192), (40, 6))
    assert e["layers.1.engram.embed.weight"].shape == (462, 32)
    assert e["layers.4.engram.embed.scale"].shape == (630, 1)
    assert (e["layers.0.ffn.experts.7.w1.weight"].shape, e["layers.0.ffn.experts.7.w1.scale"].shape) == ((64, 128), (64, 8))
    assert (e["layers.0.ffn.experts.7.w2.weight"].shape, e["layers.0.ffn.experts.7.w2.scale"].shape) == ((256, 32), (256, 2))
    assert e["layers.0.attn.wq_a.scale"].shape == (4, 8)          # 32x32 blocks of [128, 256]
    assert "layers.8.attn.indexer.wq_b.weight" in e and "layers.8.attn.indexer.wk.weight" not in e
    assert "layers.6.attn.compressor.wgate.weight" not in e and "layers.4.attn.compressor.wgate.weight" in e


# ---- round trip -------------------------------------------------------------------------------
def test_random_weights_are_seeded():
    a, b = random_weights(tiny_v41(), 3), random_weights(tiny_v41(), 3)
    n = "layers.6.attn.compressor.wkv.weight"
    assert torch.equal(a.tensors[n], b.tensors[n])
    assert not torch.equal(a.tensors[n], random_weights(tiny_v41(), 4).tensors[n])


def test_written_checkpoint_is_valid_and_reads_back_bit_for_bit(pristine, tiny_w):
    info = scan_checkpoint(pristine)
    assert info.problems == [] and len(info.shards) > 1
    assert is_v41_checkpoint(pristine)
    cfg_json = json.loads((pristine / "config.json").read_text())
    assert cfg_json["model_type"] == "deepseek_v41" and cfg_json["quantization_config"]["weight_block_size"] == [32, 32]
    assert info.tensors["layers.0.attn.wq_a.scale"].shape == (4, 8)
    w = load_checkpoint(pristine)
    assert w.cfg.differences(tiny_w.cfg) == []
    for k, v in tiny_w.tensors.items():
        got = w.tensors[k]
        if isinstance(v, EngramTable):
            assert torch.equal(got.codes.view(torch.uint8), v.codes.view(torch.uint8)), k
            assert torch.equal(got.scale.view(torch.uint8), v.scale.view(torch.uint8)), k
        else:
            assert got.dtype == v.dtype and torch.equal(got, v), k


def test_engram_rows_dequantise_as_e4m3_times_e8m0():
    """Hand values: code 0x3C = 1.5, 0x38 = 1.0, 0xC0 = -2.0; scale bytes 128 -> 2, 125 -> 1/4."""
    codes = torch.tensor([[0x3C] * 32 + [0x38] * 32, [0xC0] * 64], dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.tensor([[128, 125], [127, 130]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    rows = EngramTable(codes, scale).lookup(torch.tensor([1, 0]))
    assert rows.dtype == torch.bfloat16
    assert rows[1, :32].eq(3.0).all() and rows[1, 32:].eq(0.25).all()
    assert rows[0, :32].eq(-2.0).all() and rows[0, 32:].eq(-16.0).all()


def test_config_json_round_trips():
    from reference_model.v41.config import from_dict
    for c in (tiny_v41(), v41_flash()):
        assert from_dict(json.loads(json.dumps(hf_config_dict(c)))).differences(c) == []


# ---- bad files --------------------------------------------------------------------------------
def test_missing_wrong_shape_wrong_dtype_all_named(ck):
    _edit(ck, "layers.4.attn.indexer.wk.weight", lambda d: d.pop("layers.4.attn.indexer.wk.weight"))
    _edit(ck, "layers.2.attn.compressor.norm.weight",
          lambda d: d.update({"layers.2.attn.compressor.norm.weight": torch.zeros(64, dtype=torch.bfloat16)}))
    _edit(ck, "layers.3.ffn.gate.bias_vl",
          lambda d: d.update({"layers.3.ffn.gate.bias_vl": torch.zeros(8, dtype=torch.bfloat16)}))
    p = _problems(ck)
    assert "missing tensor: layers.4.attn.indexer.wk.weight (BF16 [128, 128])" in p
    assert any(x.startswith("wrong shape: layers.2.attn.compressor.norm.weight: expected [128], found [64]") for x in p)
    assert any(x.startswith("wrong dtype: layers.3.ffn.gate.bias_vl: expected F32, found BF16") for x in p)
    assert len(p) == 3


def test_128_block_scales_are_named(ck):
    """llama.cpp #28696: V4's 128x128 scale grid where V4.1 has 32x32 blocks."""
    n = "layers.0.attn.wq_a.scale"
    _edit(ck, n, lambda d: d.update({n: torch.full((1, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)}))
    (p,) = _problems(ck)
    assert p.startswith(f"wrong shape: {n}: expected [4, 8], found [1, 2]")
    assert "a 128x128 scale grid (DeepSeek-V4's); V4.1 weights have 32x32 blocks" in p


def test_engram_table_rows_and_scales_are_named(ck):
    n, s = "layers.4.engram.embed.weight", "layers.4.engram.embed.scale"
    _edit(ck, n, lambda d: d.update({n: d[n][:629].clone(), s: d[s][:, :1].repeat(1, 2).contiguous()}))
    p = _problems(ck)
    assert any(x.startswith(f"wrong shape: {n}: expected [630, 32], found [629, 32]")
               and "engram_num_embeddings says 630 for layer 4" in x for x in p)
    assert any(x.startswith(f"wrong shape: {s}: expected [630, 1], found [630, 2]")
               and "one E8M0 scale per 32 channels" in x for x in p)


def test_nan_scale_byte_is_named_at_load(ck):
    n = "layers.1.engram.embed.scale"

    def poison(d):
        t = d[n].view(torch.uint8).clone()
        t[5, 0] = 255
        d[n] = t.view(torch.float8_e8m0fnu)
    _edit(ck, n, poison)
    scan_checkpoint(ck)                                   # headers are fine
    with pytest.raises(CheckpointError, match="bad data: layers.1.engram.embed.scale .*E8M0 NaN byte 255"):
        load_checkpoint(ck)


def test_draft_and_vision_tensors_are_skipped(ck):
    extra = {"mtp.0.main_proj.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
             "mtp.2.markov_head.embed.weight": torch.zeros(4, 2, dtype=torch.bfloat16),
             "vision.blocks.0.attn.qkv.weight": torch.zeros(2, 2, dtype=torch.bfloat16),
             "image_newline": torch.zeros(256, dtype=torch.bfloat16)}
    _edit(ck, "embed.weight", lambda d: d.update(extra))
    info = scan_checkpoint(ck)
    assert info.problems == [] and set(info.skipped) == set(extra)
    assert any("skipped 4 draft/vision tensors" in n and "mtp.0" in n and "vision" in n for n in info.notes)


def test_v4_checkpoint_labelled_v41_is_one_named_error(tmp_path):
    root = v4_save(v4_random_weights(tiny(), seed=1), tmp_path / "v4")
    (root / "config.json").write_text(json.dumps(hf_config_dict(tiny_v41())))
    p = _problems(root)
    assert len(p) == 1
    assert p[0].startswith("config says DeepSeek-V4.1 but tensors are DeepSeek-V4 (hc_head_fn present")
    assert "layers.1.attn.compressor.ape present" in p[0]


def test_v41_checkpoint_labelled_v4_is_named_by_the_v4_reader(ck):
    (ck / "config.json").write_text(json.dumps(v4_config_dict(tiny())))
    assert not is_v41_checkpoint(ck)
    with pytest.raises(CheckpointError) as ei:
        v4_scan(ck)
    hit = [p for p in ei.value.problems if p.startswith("config says DeepSeek-V4 but tensors are DeepSeek-V4.1's")]
    assert hit and "layers.1.engram.embed.scale present" in hit[0]


def test_v4_reader_refuses_a_v41_config_by_name(pristine):
    with pytest.raises(CheckpointError, match="DeepSeek-V4.1 config .* reference_model.v41"):
        v4_scan(pristine)


# ---- CLI ------------------------------------------------------------------------------------
def test_inspect_v41_checkpoint(pristine, capsys):
    assert cli.main(["inspect", str(pristine)]) == 0
    out = capsys.readouterr().out
    assert "| 6 | c1-full | 1 |" in out and "| 8 | c1-reindex | 1 |" in out and "| 1 | swa | 0 |" in out
    assert "valid: every tensor the config needs" in out
    assert cli.main(["inspect", "--json", str(pristine)]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["problems"] == [] and s["schedule"][4]["engram"] and s["config"]["kv_source_layers"] == [2, 4, 6]


def test_inspect_reports_v41_problems(ck, capsys):
    n = "layers.0.attn.wq_a.scale"
    _edit(ck, n, lambda d: d.update({n: torch.full((1, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)}))
    assert cli.main(["inspect", str(ck)]) == 1
    assert "128x128 scale grid" in capsys.readouterr().out


def test_inspect_config_only_v41_flash(tmp_path, capsys):
    from test_v41_config import HF_V41_FLASH
    (tmp_path / "config.json").write_text(json.dumps(HF_V41_FLASH))
    assert cli.main(["inspect", "--json", str(tmp_path)]) == 0
    s = json.loads(capsys.readouterr().out)
    rows = {(t["name"], tuple(t["shape"])): t for t in s["tensors"]}
    assert rows[("layers.*.engram.embed.weight", (384006168, 256))]["count"] == 1
    assert rows[("layers.*.engram.embed.weight", (384016682, 256))]["count"] == 1
    assert rows[("layers.*.attn.wq_a.scale", (40, 160))]["count"] == 40
    assert s["total_tensors"] == len(expected_entries(v41_flash())) and s["problems"] == []


def test_plan_memory_v41_flash_preset_and_config(tmp_path, capsys):
    from test_v41_config import HF_V41_FLASH
    argv = ["--devices", "cpu", "--device-memory", "2000GB", "--length", "4096", "--json"]
    assert cli.main(["plan-memory", "--preset", "v41-flash", *argv]) == 0
    a = json.loads(capsys.readouterr().out)
    (tmp_path / "config.json").write_text(json.dumps(HF_V41_FLASH))
    assert cli.main(["plan-memory", "--config", str(tmp_path / "config.json"), *argv]) == 0
    b = json.loads(capsys.readouterr().out)
    want = sum(e.nbytes for e in expected_entries(v41_flash()).values())
    # Engram tables are host memory (memory-mapped), the rest device weights
    assert a["totals"]["host_mapped"] == b["totals"]["host_mapped"] > 0
    assert a["totals"]["weights_quantised"] == b["totals"]["weights_quantised"] == want - a["totals"]["host_mapped"]
    assert b["totals"]["weights_bf16"] > want - a["totals"]["host_mapped"]
    assert a["n_layers"] == 40 and "c1-reindex" in a["per_sequence"]["state_by_kind"]


def test_plan_memory_from_a_v41_checkpoint(pristine, capsys):
    argv = ["--devices", "cpu,cpu", "--device-memory", "1GB", "--length", "512", "--json"]
    assert cli.main(["plan-memory", "--checkpoint", str(pristine), *argv]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == "tiny-v41" and plan["n_layers"] == 10
    assert (plan["totals"]["weights_quantised"] + plan["totals"]["host_mapped"]
            == sum(e.nbytes for e in expected_entries(tiny_v41()).values()))


def test_plan_memory_v41_state_matches_the_layout():
    """One sequence of 1001 tokens: windows of 15 rows everywhere; compressed KV + index keys
    only at the KV sources (500 / 1001 entries); one open ratio-2 group; Engram history."""
    from fidelity.weights.plan import StateDtypes, sequence_state_bytes
    from reference_model.v41.sizes import sequence_state_elements
    c, n = tiny_v41(), 1001
    e = {i: sequence_state_elements(c, i, n) for i in range(10)}
    assert all(e[i]["window"] == 15 * 128 for i in range(10))
    assert [i for i in range(10) if e[i]["comp_kv"]] == [2, 4, 6]
    assert e[2]["comp_kv"] == 500 * 128 and e[6]["index_keys"] == 1001 * 128
    assert e[2]["comp"] == 2 * 128 and e[6]["comp"] == 0 and e[1]["engram"] == n and e[4]["engram"] == 0
    dt = StateDtypes(kv=2, compressor=4, index_keys=2, stream=2, compute=4)
    assert sequence_state_bytes(c, 2, n, dt) == (15 * 128 + 500 * 128) * 2 + 2 * 128 * 4 + 500 * 128 * 2


# ---- the embedded tiny V4.1 checkpoint (models/tiny-v41) ----------------------------------
def test_embedded_tiny_v41_is_the_tests_random_weights_by_name():
    """`--checkpoint tiny-v41` resolves to models/tiny-v41, whose tensors are, bit for bit,
    random_weights(tiny_v41(), 0): the in-memory goldens of the V4.1 tests are its logits."""
    from fidelity.weights.source import checkpoint_config, load_tokenizer_for, resolve_checkpoint
    from training.make_tiny_v41 import SEED
    path = resolve_checkpoint("tiny-v41")
    assert path.name == "tiny-v41" and resolve_checkpoint("embedded:tiny-v41") == path
    assert checkpoint_config("tiny-v41") == tiny_v41() and load_tokenizer_for("tiny-v41") is None
    got, want = load_checkpoint(path), random_weights(tiny_v41(), SEED)
    assert set(got.tensors) == set(want.tensors)
    for k, v in want.tensors.items():
        g = got.tensors[k]
        if isinstance(v, EngramTable):
            assert torch.equal(g.codes.view(torch.uint8), v.codes.view(torch.uint8))
            assert torch.equal(g.scale.view(torch.uint8), v.scale.view(torch.uint8))
        else:
            assert g.dtype == v.dtype and torch.equal(g, v), k
