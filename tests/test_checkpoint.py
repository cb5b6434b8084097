"""Checkpoint I/O: dequantisation against hand-computed values, bit-exact round trips
(tensors and forward logits, in memory and streamed), and the Flash tensor table checked
against a hand transcription of docs/research/dsv4-architecture.md §3.1 (tests/data/flash_tensor_patterns.txt)."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from reference_model import Model, Numerics, random_weights, tiny
from reference_model import quant as Q
from reference_model.checkpoint import (StreamingWeights, decode_fp4, decode_fp8, encode_fp4,
                                        encode_fp8, expected_entries, hf_config_dict,
                                        load_checkpoint, save_checkpoint, scan_checkpoint)
from reference_model.config import ModelConfig, flash

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def tiny_w():
    return random_weights(tiny(), seed=3)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, tiny_w):
    return save_checkpoint(tiny_w, tmp_path_factory.mktemp("ck") / "tiny", max_shard_bytes=1 << 20)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view so -0.0 != 0.0 and NaN == NaN."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _e8m0(bytes_) -> torch.Tensor:
    return torch.tensor(bytes_, dtype=torch.uint8).view(torch.float8_e8m0fnu)


# ---- dequantisation vs hand-computed values ------------------------------------------
def test_e8m0_byte_is_two_to_the_b_minus_127():
    b = [0, 1, 100, 126, 127, 128, 130, 254, 255]
    want = [5.877471754111438e-39, 1.1754943508222875e-38, 7.450580596923828e-09,
            0.5, 1.0, 2.0, 8.0, 1.7014118346046923e+38]
    got = Q.e8m0_to_float(_e8m0(b))
    assert got[:-1].tolist() == want
    assert math.isnan(got[-1].item())
    # and through the FP8 reader: weight 1.0 everywhere, one block per scale byte
    w = torch.ones(1, 128 * 8).to(torch.float8_e4m3fn)
    d = decode_fp8(w, _e8m0([b[:8]]))
    assert d.dtype == torch.bfloat16
    assert d[0, ::128].float().tolist() == want


FP4_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_fp4_nibble_table_low_nibble_first_and_negative_zero():
    # byte j holds code 2j (low nibble) and 2j+1 (high nibble): 0x10, 0x32, 0x54, ...
    row = [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    packed = torch.tensor([row, row], dtype=torch.uint8).view(torch.int8)
    d = decode_fp4(packed, _e8m0([[127], [129]]))          # scales 1 and 4
    assert d.dtype == torch.bfloat16
    assert d[0].float().tolist() == FP4_TABLE
    assert d[1].float().tolist() == [4 * v for v in FP4_TABLE]
    assert torch.signbit(d[0, 8]) and not torch.signbit(d[0, 0])      # code 8 is -0
    # the writer packs the table back to the same bytes (scale 2^0: amax 6)
    p, s = encode_fp4(torch.tensor([FP4_TABLE]))
    assert p.view(torch.uint8)[0].tolist() == row
    assert s.view(torch.uint8).tolist() == [[127]]
    # a single byte: 0x8F -> low nibble F = -6, high nibble 8 = -0
    d = decode_fp4(torch.tensor([[0x8F]], dtype=torch.uint8).view(torch.int8), _e8m0([[126]]))
    assert d.float().tolist() == [[-3.0, -0.0]] and torch.signbit(d[0, 1])


def test_fp8_block_scales_broadcast_on_non_multiple_of_128_shape():
    w = torch.ones(130, 260)
    w[129, 259] = -1.5
    w[5, 200] = 0.001953125          # e4m3 min subnormal 2^-9
    s = _e8m0([[127, 128, 129], [126, 125, 130]])             # 2x3 grid = ceil(130/128) x ceil(260/128)
    d = decode_fp8(w.to(torch.float8_e4m3fn), s).float()
    assert d.shape == (130, 260)
    expect = {(0, 0): 1.0, (127, 127): 1.0, (0, 128): 2.0, (127, 255): 2.0, (0, 256): 4.0,
              (127, 259): 4.0, (128, 0): 0.5, (129, 127): 0.5, (128, 128): 0.25,
              (129, 255): 0.25, (128, 256): 8.0, (129, 259): -12.0, (5, 200): 0.00390625}
    for (o, i), v in expect.items():
        assert d[o, i].item() == v, (o, i)
    # FP4 on an input dim that is not a multiple of 32: [1, 40] -> scales [1, 2]
    p = torch.full((1, 20), 0x22, dtype=torch.uint8).view(torch.int8)     # every element 1.0
    d4 = decode_fp4(p, _e8m0([[128, 124]])).float()
    assert d4[0, :32].tolist() == [2.0] * 32 and d4[0, 32:].tolist() == [0.125] * 8


def _all_e4m3() -> torch.Tensor:
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return v[~torch.isnan(v)]                                          # 254 finite codes


def test_fp8_writer_is_bit_exact_on_grid_values():
    g = torch.Generator().manual_seed(0)
    codes = _all_e4m3()
    w = torch.empty(200, 300)
    # blocks with every code (amax 448) and blocks with max 224 / subnormals only, at
    # scales from far below the 1e-4 act_quant floor to large
    k = [[-40, 0, 7], [-3, -60, 20]]
    for bo in range(2):
        for bi in range(3):
            blk = w[bo * 128:(bo + 1) * 128, bi * 128:(bi + 1) * 128]
            pool = codes if (bo + bi) % 2 == 0 else codes[codes.abs() <= 224]
            if (bo, bi) == (1, 1):
                pool = codes[codes.abs() < 2 ** -6]                     # subnormals
            idx = torch.randint(0, len(pool), blk.shape, generator=g)
            blk.copy_(pool[idx] * 2.0 ** k[bo][bi])
    w = w.to(torch.bfloat16)
    q, s = encode_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (2, 3)
    back = decode_fp8(q, s)
    assert torch.equal(_bits(back), _bits(w))


def test_fp4_writer_is_bit_exact_on_grid_values():
    g = torch.Generator().manual_seed(1)
    vals = torch.tensor(FP4_TABLE)
    w = vals[torch.randint(0, 16, (64, 96), generator=g)]
    w[:, 32:64] = w[:, 32:64].clamp(-3, 3)                              # blocks with amax <= 3
    w = w * 2.0 ** torch.randint(-30, 30, (64, 3), generator=g).float().repeat_interleave(32, 1)
    w = w.to(torch.bfloat16)
    p, s = encode_fp4(w)
    assert p.dtype == torch.int8 and p.shape == (64, 48) and s.shape == (64, 3)
    assert torch.equal(_bits(decode_fp4(p, s)), _bits(w))
    # the writer's table packer agrees with quant.pack_fp4's search packer
    v = Q.unpack_fp4(p)
    assert torch.equal(Q.pack_fp4(v), p)


def test_off_grid_weights_round_to_nearest():
    w = torch.tensor([[1.0, 1.2, 1.3, 2.6] + [0.0] * 28])               # amax 2.6 -> scale 0.5
    p, s = encode_fp4(w)
    assert s.view(torch.uint8).tolist() == [[126]]
    # 1.2/0.5 = 2.4 -> 2 ; 1.3/0.5 = 2.6 -> 3 ; 2.6/0.5 = 5.2 -> 6
    assert decode_fp4(p, s)[0, :4].float().tolist() == [1.0, 1.0, 1.5, 3.0]


# ---- round trip -------------------------------------------------------------------------
def test_layout_index_and_config(tiny_ckpt):
    files = sorted(p.name for p in tiny_ckpt.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    n = len(shards)
    assert n > 1 and shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert "config.json" in files and "model.safetensors.index.json" in files
    assert not any(p.name.startswith(".") for p in tiny_ckpt.parent.iterdir())   # no temp left
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected_entries(tiny()))
    assert index["metadata"]["total_size"] == sum(e.nbytes for e in expected_entries(tiny()).values())
    for f in shards:
        assert (tiny_ckpt / f).stat().st_size <= (1 << 20) + 64 * 1024       # shard size + header
    cfgj = json.loads((tiny_ckpt / "config.json").read_text())
    assert cfgj["quantization_config"]["fmt"] == "e4m3"
    assert cfgj["quantization_config"]["scale_fmt"] == "ue8m0"
    assert cfgj["quantization_config"]["weight_block_size"] == [128, 128]
    assert cfgj["expert_dtype"] == "fp4" and cfgj["compress_ratios"] == [0, 4, 128, 4, 128]
    got = ModelConfig.from_file(tiny_ckpt / "config.json").to_dict()
    assert {**got, "name": "tiny"} == tiny().to_dict()


def test_round_trip_tensors_bit_identical(tiny_w, tiny_ckpt):
    r = load_checkpoint(tiny_ckpt)
    assert set(r.tensors) == set(tiny_w.tensors)
    for k, v in tiny_w.tensors.items():
        assert r.tensors[k].dtype == v.dtype, k
        assert torch.equal(_bits(r.tensors[k]), _bits(v)), k


def test_round_trip_logits_bit_identical_in_memory_and_streamed(tiny_w, tiny_ckpt):
    tokens = torch.arange(0, 130 * 7, 7) % tiny().vocab_size    # 130 > 128: every layer kind compresses
    want = Model(tiny_w, Numerics("reference")).prefill_logits(tokens)
    got = Model(load_checkpoint(tiny_ckpt), Numerics("reference")).prefill_logits(tokens)
    assert torch.equal(got, want)
    sw = StreamingWeights(tiny_ckpt, device="cpu")
    got = Model(sw, Numerics("reference")).prefill_logits(tokens)
    assert torch.equal(got, want)
    assert sw.loads == tiny().n_layers                  # each layer loaded exactly once


def test_streaming_keeps_one_layer():
    cfg = tiny()
    w = random_weights(cfg, seed=5)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        p = save_checkpoint(w, Path(d) / "ck")
        sw = StreamingWeights(p, io_chunk_bytes=4096)            # forces handle reopening
        l1 = sw.layer_weights(1)
        assert sw._layer_i == 1 and sw.layer_weights(1) is l1 and sw.loads == 1
        l2 = sw.layer_weights(2)
        assert sw._layer_i == 2 and sw._layer is l2 and sw.loads == 2
        assert set(l2) == set(w.layer_weights(2))
        for k in l2:
            assert torch.equal(_bits(l2[k]), _bits(w.layer_weights(2)[k])), k
        with pytest.raises(IndexError):
            sw.layer_weights(cfg.n_layers)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_streaming_on_cuda(tiny_w, tiny_ckpt):
    sw = StreamingWeights(tiny_ckpt, device="cuda")
    assert sw.layer_weights(0)["attn.wq_a.weight"].is_cuda
    assert torch.equal(sw.layer_weights(0)["attn.wq_a.weight"].cpu(),
                       tiny_w.layer_weights(0)["attn.wq_a.weight"])


def test_odd_shapes_round_trip(tmp_path):
    """dims that are not multiples of 128 (FP8 grid padding) nor of 64."""
    cfg = tiny().replace(dim=160, q_lora_rank=96, o_lora_rank=80, moe_inter_dim=96,
                         vocab_size=300, n_routed_experts=5, n_layers=3, compress_ratios=(4, 128, 0),
                         n_hash_layers=1)
    w = random_weights(cfg, seed=2)
    p = save_checkpoint(w, tmp_path / "odd", max_shard_bytes=300_000)
    h = scan_checkpoint(p).tensors
    assert h["layers.0.attn.wq_a.scale"].shape == (1, 2)             # ceil(96/128) x ceil(160/128)
    assert h["layers.0.ffn.experts.0.w2.scale"].shape == (160, 3)    # [out, ceil(96/32)]
    r = load_checkpoint(p)
    for k, v in w.tensors.items():
        assert torch.equal(_bits(r.tensors[k]), _bits(v)), k
    tokens = torch.arange(20)      # "exact": the reference's FP8 act-quant needs 128-multiples
    assert torch.equal(Model(StreamingWeights(p), Numerics("exact")).prefill_logits(tokens),
                       Model(w, Numerics("exact")).prefill_logits(tokens))


def test_inference_config_json_style(tmp_path, tiny_w):
    """A checkpoint whose config is DeepSeek's inference/config.json (ModelArgs keys)."""
    p = save_checkpoint(tiny_w, tmp_path / "ck")
    hf = json.loads((p / "config.json").read_text())
    (p / "config.json").unlink()
    c = tiny()
    ma = {"vocab_size": c.vocab_size, "dim": c.dim, "n_layers": c.n_layers, "n_heads": c.n_heads,
          "head_dim": c.head_dim, "rope_head_dim": c.rope_head_dim, "q_lora_rank": c.q_lora_rank,
          "o_groups": c.o_groups, "o_lora_rank": c.o_lora_rank, "window_size": c.window_size,
          "compress_ratios": list(c.compress_ratios) + [0], "rope_theta": c.rope_theta,
          "compress_rope_theta": c.compress_rope_theta, "rope_factor": c.rope_factor,
          "original_seq_len": c.original_seq_len, "n_routed_experts": c.n_routed_experts,
          "n_activated_experts": c.n_activated_experts, "moe_inter_dim": c.moe_inter_dim,
          "route_scale": c.route_scale, "n_hash_layers": c.n_hash_layers, "score_func": "sqrtsoftplus",
          "swiglu_limit": c.swiglu_limit, "index_n_heads": c.index_n_heads,
          "index_head_dim": c.index_head_dim, "index_topk": c.index_topk, "max_seq_len": c.max_seq_len,
          "dtype": "fp8", "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    (p / "inference").mkdir()
    (p / "inference" / "config.json").write_text(json.dumps(ma))
    info = scan_checkpoint(p)
    assert info.config_file.name == "config.json" and info.config_file.parent.name == "inference"
    assert info.cfg.dim == c.dim and info.cfg.compress_ratios == c.compress_ratios
    assert hf["num_hidden_layers"] == c.n_layers


def test_single_file_checkpoint_and_mtp_skipped(tmp_path, tiny_w):
    """model.safetensors without index, with extra MTP / DSpark tensors: skipped, noted."""
    from safetensors.torch import load_file, save_file
    p = save_checkpoint(tiny_w, tmp_path / "ck")
    allt = {}
    for f in sorted(p.glob("model-*.safetensors")):
        allt.update(load_file(f))
        f.unlink()
    (p / "model.safetensors.index.json").unlink()
    allt["mtp.0.e_proj.weight"] = torch.zeros(256, 256).to(torch.float8_e4m3fn)
    allt["mtp.2.main_proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    save_file(allt, str(p / "model.safetensors"))
    sw = StreamingWeights(p)
    assert set(sw.info.skipped) == {"mtp.0.e_proj.weight", "mtp.2.main_proj.weight"}
    assert any("skipped 2 MTP/DSpark tensors (mtp.0, mtp.2)" in n for n in sw.notes)
    tokens = torch.arange(10)
    assert torch.equal(Model(sw).prefill_logits(tokens), Model(tiny_w).prefill_logits(tokens))


def test_writer_layerwise_api_and_atomicity(tmp_path, tiny_w):
    from reference_model.checkpoint import CheckpointWriter
    cfg = tiny()
    out = tmp_path / "lw"
    with CheckpointWriter(out, cfg, max_shard_bytes=1 << 30) as wr:
        wr.write_globals(tiny_w.global_weights())
        for i in range(cfg.n_layers):
            wr.write_layer(i, tiny_w.layer_weights(i))
        assert not out.exists()                          # only appears when complete
    assert len(list(out.glob("model-*.safetensors"))) == 1
    assert (out / "model-00001-of-00001.safetensors").exists()
    with pytest.raises(FileExistsError):
        CheckpointWriter(out, cfg)
    # an exception mid-way leaves nothing behind
    with pytest.raises(RuntimeError):
        with CheckpointWriter(tmp_path / "never", cfg) as wr:
            wr.write_globals(tiny_w.global_weights())
            raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lw"]
    # overwrite replaces atomically
    save_checkpoint(tiny_w, out, overwrite=True, max_shard_bytes=1 << 20)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lw"]


# ---- Flash name coverage ----------------------------------------------------------------
def _layers(spec: str) -> list[int]:
    if spec == "all":
        return list(range(43))
    m = re.fullmatch(r"(\d+)-(\d+)(?:/(\d+))?", spec)
    a, b, step = int(m[1]), int(m[2]), int(m[3] or 1)
    return list(range(a, b + 1, step))


def _flash_table() -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    for line in (DATA / "flash_tensor_patterns.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        pat, dtype, shape, where = line.split()
        shape = tuple(int(x) for x in shape.split(","))
        layers = [None] if where == "global" else _layers(where)
        for i in layers:
            for e in (range(256) if "{e}" in pat else [None]):
                name = pat.replace("{i}", str(i)).replace("{e}", str(e))
                assert name not in out, f"duplicate in test data: {name}"
                out[name] = (dtype, shape)
    return out


def test_flash_tensor_names_dtypes_shapes_match_research_table():
    table = _flash_table()
    got = {n: (e.dtype, tuple(e.shape)) for n, e in expected_entries(flash()).items()}
    assert sorted(set(table) - set(got)) == [] and sorted(set(got) - set(table)) == []
    wrong = {n: (got[n], table[n]) for n in table if got[n] != table[n]}
    assert wrong == {}
    # the hash-only and ratio-dependent tensors are really there
    tid = sorted(int(n.split(".")[1]) for n in got if n.endswith("gate.tid2eid"))
    bias = sorted(int(n.split(".")[1]) for n in got if n.endswith("gate.bias"))
    comp = sorted(int(n.split(".")[1]) for n in got if n.endswith("attn.compressor.ape"))
    idx = sorted(int(n.split(".")[1]) for n in got if n.endswith("indexer.wq_b.weight"))
    assert tid == [0, 1, 2] and bias == list(range(3, 43))
    assert comp == list(range(2, 43)) and idx == list(range(2, 43, 2))


def test_flash_table_plus_mtp_equals_real_index_total_size():
    """Bytes of the hand table + the MTP layer of §3.1 == the real index's total_size
    (159,609,485,896, docs/research/dsv4-architecture.md §2), an outside number the table must reproduce."""
    sizes = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "I64": 8}
    table = _flash_table()
    main = sum(sizes[d] * math.prod(s) for d, s in table.values())
    assert main == sum(e.nbytes for e in expected_entries(flash()).values())
    # MTP block = a window-only, scored layer: layer 0's rows minus tid2eid plus gate.bias
    blk = sum(sizes[d] * math.prod(s) for n, (d, s) in table.items()
              if n.startswith("layers.0.") and not n.endswith("tid2eid"))
    blk += 4 * 256
    mtp_extra = 2 * (4096 * 4096 + 32 * 32) + 3 * 2 * 4096 + 4 * (4 * 16384 + 4 + 1)
    assert main + blk + mtp_extra == 159_609_485_896


@pytest.fixture(scope="module")
def flash_sparse(tmp_path_factory):
    """A full-size Flash layout as sparse shards (headers, no data) plus one MTP tensor."""
    root = tmp_path_factory.mktemp("flash") / "DeepSeek-V4-Flash"
    ents = [(e.name, e.dtype, list(e.shape)) for e in expected_entries(flash()).values()]
    ents.append(("mtp.0.e_proj.weight", "F8_E4M3", [4096, 4096]))
    _sparse_checkpoint(root, ents, hf_config_dict(flash()), n_shards=3)
    return root


def test_flash_header_only_checkpoint_scans(flash_sparse):
    info = scan_checkpoint(flash_sparse)
    assert info.cfg.n_layers == 43 and len(info.tensors) == len(_flash_table())
    assert set(info.skipped) == {"mtp.0.e_proj.weight"}


def test_inspect_prints_config_schedule_and_dtype_table(flash_sparse, monkeypatch, capsys):
    from fidelity import cli
    import reference_model.checkpoint_shards as R             # where shards are opened
    assert cli.COMMANDS["inspect"] == "inspect"
    monkeypatch.setattr(cli, "COMMANDS", {"inspect": "inspect"})   # isolate from other subcommands
    monkeypatch.setattr(R, "safe_open", None)                       # proves no tensor is loaded
    assert cli.main(["inspect", str(flash_sparse)]) == 0
    out = capsys.readouterr().out
    assert "  dim                    4096" in out and "  n_layers               43" in out
    assert "| 0 | swa | 0 | hash | 10000 | no |" in out
    assert "| 2 | csa | 4 | hash | 160000 | yes |" in out
    assert "| 3 | hca | 128 | score | 160000 | yes |" in out
    assert "| 42 | csa | 4 | score | 160000 | yes |" in out
    # counts per dtype from the hand table (+ the one MTP tensor, F8_E4M3 16 MiB)
    sizes = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "I64": 8}
    per = {}
    for d, shp in _flash_table().values():
        c = per.setdefault(d, [0, 0])
        c[0] += 1
        c[1] += sizes[d] * math.prod(shp)
    per["F8_E4M3"][0] += 1
    per["F8_E4M3"][1] += 4096 * 4096
    for d, (n, b) in per.items():
        assert f"| {d} | {n} | {b} |" in out, d
    total = sum(b for _, b in per.values())
    assert f"| **total** | {sum(n for n, _ in per.values())} | {total} |" in out
    assert "skipped 1 MTP/DSpark tensors (mtp.0)" in out and "valid:" in out
    assert cli.main(["inspect", "--json", str(flash_sparse)]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["total_bytes"] == total and js["schedule"][41]["kind"] == "hca"


def test_inspect_exit_codes(tiny_ckpt, tmp_path, capsys):
    import argparse
    import shutil
    from fidelity import cli
    from fidelity.commands import inspect as I
    ap = argparse.ArgumentParser()
    I.add_arguments(ap)
    bad = Path(shutil.copytree(tiny_ckpt, tmp_path / "bad"))
    c = json.loads((bad / "config.json").read_text())
    c["num_hidden_layers"], c["compress_ratios"] = 4, [0, 4, 128, 4]
    (bad / "config.json").write_text(json.dumps(c))
    assert I.run(ap.parse_args([str(bad)])) == 1
    out = capsys.readouterr().out
    assert "INVALID" in out and "unexpected tensor: layers.4.attn.wq_a.weight" in out
    assert cli.main(["inspect", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _sparse_checkpoint(root: Path, entries, config: dict, n_shards: int = 1):
    """Write safetensors headers and extend the files sparsely to their full size."""
    from reference_model.checkpoint_format import DTYPE_BYTES
    import struct
    root.mkdir(parents=True, exist_ok=True)
    chunks = [entries[k::n_shards] for k in range(n_shards)]
    wm, total = {}, 0
    for k, chunk in enumerate(chunks):
        fname = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        hdr, off = {}, 0
        for name, dt, shape in chunk:
            nb = DTYPE_BYTES[dt] * math.prod(shape)
            hdr[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + nb]}
            off += nb
            wm[name] = fname
        raw = json.dumps(hdr).encode()
        raw += b" " * (-len(raw) % 8)
        with open(root / fname, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            fh.truncate(8 + len(raw) + off)
        total += off
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": wm}))
    (root / "config.json").write_text(json.dumps(config))
