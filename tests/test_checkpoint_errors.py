"""Bad checkpoints: every problem is named, all of them in ONE CheckpointError."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from reference_model import random_weights, tiny
from reference_model.checkpoint import (CheckpointError, StreamingWeights, save_checkpoint,
                                        scan_checkpoint)

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def tiny_w():
    return random_weights(tiny(), seed=11)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tiny_w):
    return save_checkpoint(tiny_w, tmp_path_factory.mktemp("ck") / "tiny", max_shard_bytes=1 << 20)


@pytest.fixture
def ck(pristine, tmp_path) -> Path:
    """A fresh copy to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "tiny"))


def _index(root):
    return json.loads((root / INDEX).read_text())


def _set_index(root, idx):
    (root / INDEX).write_text(json.dumps(idx))


def _edit(root: Path, name: str, fn, update_index: bool = True):
    """Apply fn(dict of the shard holding `name`) and rewrite that shard (and index)."""
    idx = _index(root)
    f = idx["weight_map"][name]
    d = load_file(root / f)
    fn(d)
    save_file(d, str(root / f))
    if update_index:
        wm = {k: v for k, v in idx["weight_map"].items() if v != f}
        wm.update({k: f for k in d})
        idx["weight_map"] = wm
        _set_index(root, idx)
    return f


def _error(root, **kw) -> CheckpointError:
    with pytest.raises(CheckpointError) as ei:
        scan_checkpoint(root, **kw)
    return ei.value


def test_pristine_is_valid(pristine):
    info = scan_checkpoint(pristine)
    assert info.problems == [] and info.notes == []


def test_missing_tensors_are_all_listed(ck):
    gone = ["layers.1.attn.wq_a.scale", "layers.3.ffn.experts.7.w2.weight", "embed.weight"]
    for n in gone:
        _edit(ck, n, lambda d, n=n: d.pop(n))
    e = _error(ck)
    assert len(e.problems) == 3
    for n in gone:
        assert any(p.startswith(f"missing tensor: {n} ") for p in e.problems), n
    assert "layers.1.attn.wq_a.scale (F8_E8M0 [1, 2])" in str(e)


def test_unexpected_tensors_are_all_listed(ck):
    def add(d):
        d["layers.0.attn.bogus.weight"] = torch.zeros(3, dtype=torch.bfloat16)
        d["layers.2.ffn.gate.bias_vl"] = torch.zeros(8)
    _edit(ck, "layers.0.attn_norm.weight", add)
    e = _error(ck)
    assert [p.split(" (")[0] for p in e.problems] == ["unexpected tensor: layers.0.attn.bogus.weight",
                                                      "unexpected tensor: layers.2.ffn.gate.bias_vl"]


def test_wrong_shapes_and_dtypes_are_all_listed(ck):
    _edit(ck, "layers.0.attn_norm.weight",
          lambda d: d.__setitem__("layers.0.attn_norm.weight", torch.ones(255, dtype=torch.bfloat16)))
    _edit(ck, "layers.2.attn.attn_sink",
          lambda d: d.__setitem__("layers.2.attn.attn_sink", d["layers.2.attn.attn_sink"].bfloat16()))
    _edit(ck, "layers.1.attn.wq_b.weight",       # stored dequantised instead of FP8
          lambda d: d.__setitem__("layers.1.attn.wq_b.weight", d["layers.1.attn.wq_b.weight"].bfloat16()))
    e = _error(ck)
    msg = str(e)
    assert len(e.problems) == 3, msg
    assert "wrong shape: layers.0.attn_norm.weight: expected [256], found [255]" in msg
    assert "wrong dtype: layers.2.attn.attn_sink: expected F32, found BF16" in msg
    assert "wrong dtype: layers.1.attn.wq_b.weight: expected F8_E4M3, found BF16" in msg


def test_config_with_fewer_layers_than_checkpoint(ck):
    c = json.loads((ck / "config.json").read_text())
    c["num_hidden_layers"], c["compress_ratios"] = 4, [0, 4, 128, 4]
    c["n_routed_experts"] = 6
    (ck / "config.json").write_text(json.dumps(c))
    e = _error(ck)
    msg = str(e)
    assert "config mismatch: checkpoint has layers 0..4 (5 layers), config n_layers=4" in msg
    assert "config mismatch: checkpoint has experts 0..7, config n_routed_experts=6" in msg
    assert "unexpected tensor: layers.4.attn.wq_a.weight" in msg
    assert "unexpected tensor: layers.0.ffn.experts.7.w1.weight" in msg
    assert "wrong shape: layers.0.ffn.gate.weight: expected [6, 256], found [8, 256]" in msg


def test_given_config_differs_from_config_json(pristine):
    e = _error(pristine, cfg=tiny().replace(window_size=64, index_topk=8))
    assert e.problems == ["config mismatch: window_size: config.json has 32, given config has 64",
                          "config mismatch: index_topk: config.json has 16, given config has 8"]


def test_unsupported_quantization_config(ck):
    c = json.loads((ck / "config.json").read_text())
    c["quantization_config"]["weight_block_size"] = [64, 64]
    c["expert_dtype"] = "fp8"
    (ck / "config.json").write_text(json.dumps(c))
    msg = str(_error(ck))
    assert "quantization_config.weight_block_size is [64, 64]" in msg
    assert "expert_dtype is 'fp8'" in msg


def test_invalid_or_missing_config_json(ck):
    (ck / "config.json").write_text("{ not json")
    assert "config.json is invalid" in str(_error(ck))
    (ck / "config.json").unlink()
    assert "no config.json" in str(_error(ck))


def test_truncated_shard_named_by_file(ck):
    f = sorted(ck.glob("model-*.safetensors"))[1]
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    e = _error(ck)
    assert len(e.problems) == 1                      # its tensors are not listed one by one
    assert e.problems[0].startswith(f"corrupt shard: {f.name}: truncated")


def test_corrupt_header_named_by_file(ck):
    f = sorted(ck.glob("model-*.safetensors"))[0]
    data = bytearray(f.read_bytes())
    data[8:16] = b"\xff\xfegarbg"
    f.write_bytes(bytes(data))
    e = _error(ck)
    assert e.problems == [f"corrupt shard: {f.name}: header is not valid JSON "
                          + e.problems[0].split("header is not valid JSON ")[1]]
    f.write_bytes(b"abc")
    assert f"corrupt shard: {f.name}: file is 3 bytes" in str(_error(ck))


def test_index_points_at_missing_shard(ck):
    f = sorted(ck.glob("model-*.safetensors"))[2]
    n = sum(1 for v in _index(ck)["weight_map"].values() if v == f.name)
    f.unlink()
    e = _error(ck)
    assert e.problems == [f"missing shard: {f.name} (the index maps {n} tensors to it)"]


def test_index_inconsistent_with_shards(ck):
    idx = _index(ck)
    shards = sorted(set(idx["weight_map"].values()))
    name = next(k for k, v in idx["weight_map"].items() if v == shards[0])
    other = next(k for k, v in idx["weight_map"].items() if v == shards[1])
    idx["weight_map"][name] = shards[1]
    del idx["weight_map"][other]
    _set_index(ck, idx)
    msg = str(_error(ck))
    assert f"maps {name} to {shards[1]}, but it is in {shards[0]}" in msg
    assert f"{other} is in {shards[1]} but not in {INDEX}" in msg


def test_every_kind_of_problem_in_one_error(ck):
    shards = sorted(ck.glob("model-*.safetensors"))
    victim = shards[-1]
    names_elsewhere = [k for k, v in _index(ck)["weight_map"].items() if v != victim.name]
    miss, wrong = names_elsewhere[0], "layers.0.hc_attn_base"
    assert _index(ck)["weight_map"][wrong] != victim.name
    _edit(ck, miss, lambda d: d.pop(miss))
    _edit(ck, wrong, lambda d: d.__setitem__(wrong, d[wrong].double()))
    _edit(ck, wrong, lambda d: d.__setitem__("layers.0.extra", torch.zeros(1)))
    victim.write_bytes(victim.read_bytes()[:-1])
    c = json.loads((ck / "config.json").read_text())
    c["quantization_config"]["fmt"] = "e5m2"
    (ck / "config.json").write_text(json.dumps(c))
    e = _error(ck)
    kinds = sorted(p.split(":")[0] for p in e.problems)
    assert kinds == ["config", "corrupt shard", "missing tensor", "unexpected tensor", "wrong dtype"], e
    with pytest.raises(CheckpointError):            # the streaming source validates up front
        StreamingWeights(ck)


def test_data_errors_found_at_load_name_the_tensor(ck):
    _edit(ck, "layers.2.attn.wkv.scale",
          lambda d: d["layers.2.attn.wkv.scale"].view(torch.uint8).fill_(255))
    sw = StreamingWeights(ck)                     # headers are fine
    sw.layer_weights(1)
    with pytest.raises(CheckpointError, match=r"bad data: layers\.2\.attn\.wkv\.scale in model-\d+-of-\d+\.safetensors: scale contains the E8M0 NaN byte 255"):
        sw.layer_weights(2)
    _edit(ck, "layers.3.attn.wo_b.weight",
          lambda d: d["layers.3.attn.wo_b.weight"].view(torch.uint8)[5, 7].fill_(0xFF))
    with pytest.raises(CheckpointError, match=r"bad data: layers\.3\.attn\.wo_b\.weight in \S+: weight contains e4m3 NaN"):
        sw.layer_weights(3)
    _edit(ck, "layers.0.ffn.gate.tid2eid", lambda d: d["layers.0.ffn.gate.tid2eid"].__setitem__(3, 99))
    with pytest.raises(CheckpointError, match=r"bad data: layers\.0\.ffn\.gate\.tid2eid in \S+: expert ids outside \[0, 8\)"):
        StreamingWeights(ck).layer_weights(0)


class _Src:
    """A WeightSource with one missing, one misshaped and one extra tensor."""

    def __init__(self, w):
        self.cfg, self.w = w.cfg, w

    def global_weights(self):
        g = dict(self.w.global_weights())
        g["norm.weight"] = g["norm.weight"][:-1]
        return g

    def layer_weights(self, i):
        d = dict(self.w.layer_weights(i))
        if i == 1:
            d.pop("attn.wkv.weight")
            d["attn.extra"] = torch.zeros(1)
        if i == 0:
            d["ffn.gate.tid2eid"] = d["ffn.gate.tid2eid"].float()
        return d


def test_writer_lists_every_bad_input_and_leaves_nothing(tmp_path, tiny_w):
    with pytest.raises(CheckpointError) as ei:
        save_checkpoint(_Src(tiny_w), tmp_path / "out")
    assert ei.value.problems == [
        "wrong shape: norm.weight: expected [256], got [255]",
        "wrong dtype: layers.0.ffn.gate.tid2eid: expected integer expert ids, got torch.float32",
        "unexpected tensor: layers.1.attn.extra",
        "missing tensor: layers.1.attn.wkv.weight",
    ]
    assert list(tmp_path.iterdir()) == []


def test_writer_rejects_unknown_names_of_in_memory_weights(tmp_path, tiny_w):
    from reference_model import InMemoryWeights
    w = InMemoryWeights(tiny(), {**tiny_w.tensors, "foo": torch.zeros(1), "layers.9.x": torch.zeros(1),
                                 "layers.2.attn.bar": torch.zeros(1)})
    with pytest.raises(CheckpointError) as ei:
        save_checkpoint(w, tmp_path / "out")
    assert ei.value.problems == ["unexpected tensor: foo", "unexpected tensor: layers.9.x",
                                 "unexpected tensor: layers.2.attn.bar"]
    assert list(tmp_path.iterdir()) == []


def test_not_a_checkpoint(tmp_path):
    assert "does not exist" in str(_error(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 1}))
    e = _error(tmp_path)
    assert "config.json is invalid" in str(e)
