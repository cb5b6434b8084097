"""`fidelity plan-memory` and `fidelity inspect` on a config-only folder: the weight terms
against the on-disk table and an independent spec sum, the state formula against a real
Model run, placement, verdicts and bad input."""
import json
import math

import pytest
import torch

from fidelity.weights.plan_devices import POSITION_STAT_BYTES
from fidelity.cli import main
from fidelity.weights import plan as PM
from reference_model import Model, Numerics, random_weights, tiny
from reference_model.checkpoint_format import expected_entries
from reference_model.checkpoint_write import hf_config_dict
from reference_model.config import flash
from reference_model.placement import place_layers
from reference_model.specs import all_specs, global_specs

BIG = 10 ** 15           # a budget nothing exceeds


def _cli(argv):
    return main(["plan-memory", *argv])


# ---- weights ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n_dev", [1, 8])
def test_flash_resident_quantised_weights_equal_the_on_disk_table(n_dev):
    cfg = flash()
    plan = PM.plan_memory(cfg, PM.PlanDevices(["cpu"] * n_dev, BIG), PM.PassSpec(1, 1, 1, "resident-quantised"))
    disk = sum(e.nbytes for e in expected_entries(cfg).values())
    assert sum(d.weights for d in plan.devices) == disk == plan.totals["weights_quantised"]
    assert disk == 156_015_698_140            # the real index's total_size minus the MTP layer


def test_flash_resident_bf16_weights_equal_numel_times_dtype_size():
    cfg = flash()
    size = {"fp8": 2, "fp4": 2, "bf16": 2, "f32": 4, "i64": 8}     # in-memory bytes per element
    want = sum(math.prod(s.shape) * size[s.fmt] for s in all_specs(cfg))
    plan = PM.plan_memory(cfg, PM.PlanDevices(["cpu"] * 3, BIG), PM.PassSpec(1, 1, 1, "resident-bf16"))
    assert sum(d.weights for d in plan.devices) == want == plan.totals["weights_bf16"]
    assert all(d.dequant == 0 for d in plan.devices)
    from reference_model.weights import meta_weights           # the meta tensors agree
    assert sum(t.nbytes for t in meta_weights(cfg).tensors.values()) == want


def test_streamed_weights_are_globals_plus_the_largest_layer():
    cfg = flash()
    plan = PM.plan_memory(cfg, PM.PlanDevices("cpu", BIG), PM.PassSpec(1, 1, 1, "streamed"))
    g = sum(math.prod(s.shape) * (4 if s.fmt == "f32" else 2) for s in global_specs(cfg))
    assert plan.devices[0].weights == g + plan.totals["largest_layer_bf16"]
    assert plan.totals["largest_layer_bf16"] == max(PM.layer_weight_bytes(cfg, i, "bf16")
                                                    for i in range(cfg.n_layers))


def test_dequant_buffers_full_and_expert_sparse():
    cfg = flash()
    full = PM.plan_memory(cfg, PM.PlanDevices("cpu", BIG), PM.PassSpec(1, 1, 1, "resident-quantised"))
    sparse = PM.plan_memory(cfg, PM.PlanDevices("cpu", BIG),
                              PM.PassSpec(1, 1, 1, "resident-quantised", "expert-sparse"))
    # full: every FP8/FP4 tensor of the largest layer as bf16
    assert full.devices[0].dequant == max(PM.dequant_buffer_bytes(cfg, i) for i in range(43))
    # one token: the non-expert FP8 tensors, the shared expert and 6 routed experts
    expert = 3 * cfg.dim * cfg.moe_inter_dim * 2
    base = full.devices[0].dequant - cfg.n_routed_experts * expert
    assert sparse.devices[0].dequant == base + cfg.n_activated_experts * expert
    long = PM.plan_memory(cfg, PM.PlanDevices("cpu", BIG),
                            PM.PassSpec(4096, 1, 1, "resident-quantised", "expert-sparse"))
    assert long.devices[0].dequant == full.devices[0].dequant      # bounded by n_routed_experts


# ---- state -----------------------------------------------------------------------------------
def _state_bytes(layer_state) -> int:
    n = 0
    for v in vars(layer_state).values():
        if isinstance(v, torch.Tensor):
            n += v.numel() * v.element_size()
        elif hasattr(v, "__dataclass_fields__"):
            n += _state_bytes(v)
    return n


@pytest.mark.parametrize("profile,chunks", [
    ("reference", [150, 53, 1]),            # chunked prefill + a decode step: 204 tokens
    ("exact", [203]),
    ("reference-fp32", [3]),                # shorter than one ratio-4 group
    ("exact", [130, 1, 1]),
])
def test_state_formula_matches_a_model_run(profile, chunks):
    cfg = tiny()
    nx = {"reference": Numerics("reference"), "exact": Numerics("exact"),
          "reference-fp32": Numerics("reference", torch.float32)}[profile]
    model = Model(random_weights(cfg, 0), nx, chunk_tokens=64)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (sum(chunks),), generator=g)
    st, a = None, 0
    for n in chunks:
        _, st = model.extend(tokens[a:a + n], st, logits="none")
        a += n
    L = sum(chunks)
    dt = PM.state_dtypes(profile)
    for i, ls in enumerate(st.layers):
        assert _state_bytes(ls) == PM.sequence_state_bytes(cfg, i, L, dt), (profile, i)
    plan = PM.plan_memory(cfg, PM.PlanDevices("cpu", BIG), PM.PassSpec(L, 3, 2, "resident-bf16"),
                          PM.PlanNumerics.of(profile))
    assert plan.devices[0].state == 6 * sum(_state_bytes(ls) for ls in st.layers)
    assert plan.per_sequence["state"] == sum(_state_bytes(ls) for ls in st.layers)


def test_state_dtypes_follow_the_profile():
    assert PM.state_dtypes("reference") == PM.StateDtypes(kv=8, compressor=8, index_keys=4,
                                                          stream=2, compute=8)
    assert PM.state_dtypes("exact") == PM.StateDtypes(4, 4, 4, 4, 4)
    assert PM.state_dtypes("reference-fp32") == PM.StateDtypes(4, 4, 4, 2, 4)


def test_streams_and_logits():
    cfg = flash()
    plan = PM.plan_memory(cfg, PM.PlanDevices(["cpu", "cpu"], BIG), PM.PassSpec(8192, 6, 2, "resident-quantised"))
    stream = 8192 * cfg.hc_mult * cfg.dim * 2                    # bf16 [tokens, hc, dim]
    assert all(d.streams == (12 + 2) * stream for d in plan.devices)
    assert plan.devices[0].logits == 0
    # one head chunk of logits per arm (the layers' 2048 tokens), per-position stats for all
    assert plan.devices[-1].logits == 2 * (2048 * cfg.vocab_size * 4 + 8192 * POSITION_STAT_BYTES)
    last = PM.plan_memory(cfg, PM.PlanDevices(["cpu", "cpu"], BIG),
                          PM.PassSpec(8192, 6, 2, "resident-quantised", logits_mode="last"))
    assert last.devices[-1].logits == 2 * (cfg.vocab_size * 4 + POSITION_STAT_BYTES)


# ---- placement -------------------------------------------------------------------------------
def test_placement_over_two_cpus_splits_the_layers():
    cfg = flash()
    plan = PM.plan_memory(cfg, PM.PlanDevices(["cpu", "cpu"], BIG), PM.PassSpec(1024, 1, 1, "resident-quantised"))
    a, b = plan.devices
    assert a.layers and b.layers and a.layers + b.layers == list(range(cfg.n_layers))
    assert a.globals == ["embed.weight"] and "head.weight" in b.globals
    assert abs(a.weights - b.weights) <= max(PM.layer_weight_bytes(cfg, i, "quantised")
                                             for i in range(cfg.n_layers))
    assert a.state > 0 and b.state > 0


def test_place_layers_is_optimal_and_contiguous():
    r = place_layers([5, 1, 1, 1, 1, 5], 3)
    assert [list(x) for x in r] == [[0], [1, 2, 3, 4], [5]]
    r = place_layers([1] * 4, 6)                              # more devices than layers
    assert sum(len(x) for x in r) == 4 and all(len(x) <= 1 for x in r)
    r = place_layers([3, 3, 3, 3], 2, first_extra=6)          # embed weighs on device 0
    assert [list(x) for x in r] == [[0], [1, 2, 3]]


# ---- verdicts --------------------------------------------------------------------------------
def test_a_plan_that_fits_exits_0(capsys):
    assert _cli(["--preset", "flash", "--devices", ",".join(f"cuda:{i}" for i in range(8)),
                 "--device-memory", "96GB", "--length", "8192", "--batch", "6",
                 "--n-arms", "2"]) == 0
    out = capsys.readouterr().out
    assert "FITS: tightest device cuda:7" in out and "| cuda:0 | 0-" in out


def test_a_plan_that_does_not_fit_reports_numbers(capsys):
    cfg = flash()
    plan = PM.plan_memory(cfg, PM.PlanDevices("cuda:0", "141GB"), PM.PassSpec(8192, 6, 2, "resident-quantised"))
    assert not plan.fits and plan.devices[0].budget == 141 * 10 ** 9
    d = plan.devices[0]
    assert d.total - d.budget == -d.free > 0
    assert _cli(["--preset", "flash", "--devices", "cuda:0", "--device-memory", "141GB",
                 "--length", "8192", "--batch", "6", "--n-arms", "2"]) == 1
    out = capsys.readouterr().out
    assert f"DOES NOT FIT: cuda:0 needs {d.total / 2**30:.2f} GiB of 131.32 GiB (over by " \
           f"{-d.free / 2**30:.2f} GiB)" in out
    assert "streamed weights (--weights-mode streamed): fits" in out
    assert "more devices: 2 x 131.32 GiB (141 GB) fit" in out
    # the suggestions hold: streamed weights fit, 2 devices fit
    assert PM.plan_memory(cfg, PM.PlanDevices("cuda:0", "141GB"), PM.PassSpec(8192, 6, 2, "streamed")).fits
    assert PM.plan_memory(cfg, PM.PlanDevices("cuda:0,cuda:1", "141GB"), PM.PassSpec(8192, 6, 2)).fits


def test_advice_numbers_are_the_largest_that_fit():
    cfg = flash()
    devs = [f"cuda:{i}" for i in range(8)]
    # the logits are never held whole (a head chunk at a time): 64K fits (193 GiB before)
    assert PM.plan_memory(cfg, PM.PlanDevices(devs, "96GB"), PM.PassSpec(65536, 6, 2, "resident-quantised")).fits
    plan = PM.plan_memory(cfg, PM.PlanDevices(devs, "96GB"), PM.PassSpec(131072, 6, 2, "resident-quantised"))
    assert not plan.fits
    line = next(a for a in plan.advice if a.startswith("shorter length"))
    n = int(line.split("up to ")[1].split()[0])
    assert PM.plan_memory(cfg, PM.PlanDevices(devs, "96GB"), PM.PassSpec(n, 6, 2)).fits
    assert not PM.plan_memory(cfg, PM.PlanDevices(devs, "96GB"), PM.PassSpec(n + 1, 6, 2)).fits
    assert any(a.startswith("logits of the last position only") and a.endswith("not enough on its own")
               for a in plan.advice)


def test_json_output(capsys):
    assert _cli(["--preset", "tiny", "--device-memory", "1GB", "--length", "1000", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["fits"] and js["devices"][0]["device"] == "cpu" and js["devices"][0]["total"] > 0


def test_checkpoint_and_config_sources(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(flash())))
    for src in (["--checkpoint", str(tmp_path)], ["--config", str(tmp_path / "config.json")]):
        assert _cli(src + ["--device-memory", "2TB", "--length", "4096"]) == 0
    assert "43 layers" in capsys.readouterr().out


# ---- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,msg", [
    (["--devices", "tpu:0"], "unknown device 'tpu:0'"),
    (["--devices", "cuda:0,cuda:0"], "cuda:0 is listed twice"),
    (["--length", "2000000"], "length 2000000 exceeds the config's max_seq_len 1048576 (by 951424 tokens)"),
    (["--length", "0"], "length must be a positive integer"),
    (["--batch", "0"], "prompts must be a positive integer"),
    (["--device-memory", "lots"], "cannot read size 'lots'"),
    (["--device-memory", "None"], "cannot read size"),
    (["--device-memory", "1GB,2GB"], "2 device memory sizes for 1 devices"),
])
def test_bad_input_exits_2_naming_it(argv, msg, capsys):
    base = {"--devices": "cpu", "--device-memory": "96GB", "--length": "8192", "--batch": "1"}
    for k, v in zip(argv[::2], argv[1::2]):
        base[k] = v
    args = ["--preset", "flash"] + [x for kv in base.items() for x in kv]
    assert _cli(args) == 2
    assert msg in capsys.readouterr().err


def test_cpu_needs_a_memory_budget(capsys):
    assert _cli(["--preset", "tiny", "--length", "10"]) == 2
    assert "--device-memory is required for cpu" in capsys.readouterr().err


def test_a_config_that_does_not_parse_exits_2(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    assert _cli(["--config", str(bad), "--device-memory", "1GB", "--length", "10"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    c = hf_config_dict(flash())
    del c["hidden_size"]
    bad.write_text(json.dumps(c))
    assert _cli(["--config", str(bad), "--device-memory", "1GB", "--length", "10"]) == 2
    assert "missing field(s) dim" in capsys.readouterr().err
    assert _cli(["--checkpoint", str(tmp_path / "nope"), "--device-memory", "1GB",
                 "--length", "10"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_parse_size():
    assert PM.parse_size("96GB") == 96 * 10 ** 9
    assert PM.parse_size("141 GiB") == 141 * 2 ** 30
    assert PM.parse_size("1.5T") == 1_500_000_000_000
    assert PM.parse_size("4096") == 4096
    with pytest.raises(PM.PlanError):
        PM.parse_size("12 iB")


# ---- fidelity inspect on a config-only folder -----------------------------------------------
def test_inspect_config_only_folder(tmp_path, monkeypatch, capsys):
    from fidelity import cli
    import reference_model.checkpoint_shards as R             # where shards are opened
    monkeypatch.setattr(cli, "COMMANDS", {"inspect": "inspect"})
    monkeypatch.setattr(R, "safe_open", None)                  # nothing is loaded
    root = tmp_path / "DeepSeek-V4-Flash"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(hf_config_dict(flash())))
    assert cli.main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "config only" in out and "  n_layers               43" in out
    assert "| 0 | swa | 0 | hash | 10000 | no | 1565 | 3.32 GiB |" in out
    assert "| 42 | csa | 4 | score | 160000 | yes | 1576 |" in out
    ents = expected_entries(flash())
    assert "| layers.*.ffn.experts.*.w1.weight | I8 | [2048, 2048] | 11008 | 4194304 | " \
           f"{11008 * 4194304} | 43.00 GiB |" in out
    assert f"| **total** | {len(ents)} | {sum(e.nbytes for e in ents.values())} | 145.30 GiB |" in out
    assert cli.main(["inspect", "--json", str(root)]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["config_only"] and js["total_bytes"] == sum(e.nbytes for e in ents.values())
    assert sum(t["bytes"] for t in js["tensors"]) == js["total_bytes"]
    assert sum(r["bytes"] for r in js["schedule"]) + sum(
        e.nbytes for n, e in ents.items() if not n.startswith("layers.")) == js["total_bytes"]


def test_inspect_config_only_tiny_all_tensors_and_bad_config(tmp_path, capsys):
    import argparse
    from fidelity.commands import inspect as I
    ap = argparse.ArgumentParser()
    I.add_arguments(ap)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(tiny())))
    assert I.run(ap.parse_args([str(tmp_path), "--all-tensors"])) == 0
    out = capsys.readouterr().out
    for name, e in expected_entries(tiny()).items():
        assert f"| {name} | {e.dtype} | {list(e.shape)} | 1 | {e.nbytes} |" in out
    (tmp_path / "config.json").write_text("{}")
    assert main(["inspect", str(tmp_path)]) == 2
    assert "is invalid" in capsys.readouterr().err


def test_cuda_memory_is_read_from_torch_or_asked_for(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _cli(["--preset", "tiny", "--devices", "cuda:1", "--length", "10"]) == 2
    assert "cuda:1 is not visible (torch.cuda.device_count() = 0); pass --device-memory" \
        in capsys.readouterr().err

    class Props:
        total_memory = 80 * 2 ** 30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    plan = PM.plan_memory(tiny(), PM.PlanDevices("cuda:0,cuda:1"), PM.PassSpec(10))
    assert [d.budget for d in plan.devices] == [80 * 2 ** 30] * 2 and plan.fits


def test_nodes_plan_one_pipeline_over_every_nodes_devices():
    """--nodes 2: the devices are one node's, repeated; one pipeline over all 16."""
    cfg = flash()
    devs = [f"cuda:{i}" for i in range(8)]
    one = PM.plan_memory(cfg, PM.PlanDevices(devs, "96GB"), PM.PassSpec(8192, 6, 2, "resident-quantised"))
    two = PM.plan_memory(cfg, PM.PlanDevices(devs, "96GB", 2), PM.PassSpec(8192, 6, 2, "resident-quantised"))
    assert [d.device for d in two.devices] == [f"cuda:{i}@node{k}" for k in range(2) for i in range(8)]
    assert sum((d.layers for d in two.devices), []) == list(range(cfg.n_layers))
    assert two.fits and max(d.weights for d in two.devices) < max(d.weights for d in one.devices)
    assert sum(d.weights for d in two.devices) == sum(d.weights for d in one.devices)
    with pytest.raises(PM.PlanError, match="nodes must be a positive integer"):
        PM.plan_memory(cfg, PM.PlanDevices(devs, "96GB", 0), PM.PassSpec(8192))


def test_arms_is_refused_as_a_count(capsys):
    """--arm names arms elsewhere (ab, kld, needle); here the count is --n-arms."""
    assert _cli(["--preset", "flash", "--length", "8192", "--arm", "2"]) == 2
    assert "use --n-arms 2" in capsys.readouterr().err


def test_the_plans_head_sizes_are_the_heads_own():
    """The plan sizes the A/B head's chunk from its own constants (weights imports nothing of
    ab): they must be what fidelity.ab.head keeps and reduces."""
    from fidelity.ab import head
    assert POSITION_STAT_BYTES == head.position_stat_bytes()

