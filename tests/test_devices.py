"""Devices: the device list is checked against the machine, the accumulation dtype follows
the hardware, layers placed across a device list (["cpu", "cpu"] runs the transfer path)
give bit-identical logits and lockstep tables, and the commands refuse a missing device."""
import pandas as pd
import pytest
import torch

from fidelity.cli import main
from fidelity.weights.devices import DeviceError, accumulate_dtype, default_threads, parse_devices
from fidelity.ab.lockstep import LockstepArm, LockstepRunner, Prompt, RunnerSettings
from kernel_toggles import ToggleSet
from reference_model import Model, Numerics, tiny
from reference_model.weights import random_weights


def test_parse_and_accumulate():
    assert parse_devices(None) == ("cpu",) and parse_devices("cpu, cpu") == ("cpu", "cpu")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(DeviceError, match=f"cuda:{n} does not exist: this machine has {n} CUDA"):
        parse_devices(f"cuda:{n}")
    with pytest.raises(DeviceError, match="not a device"):
        parse_devices("gpu0")
    assert accumulate_dtype(("cpu",)) == torch.float64 and accumulate_dtype(("cpu",), "fp32") == torch.float32
    assert 1 <= default_threads() <= (__import__("os").cpu_count() or 1)


def test_placement_over_two_devices_is_bit_identical():
    w = random_weights(tiny(), seed=3)
    t = torch.randint(2, 500, (150,), generator=torch.Generator().manual_seed(0))
    for nx in (Numerics("reference"), ToggleSet.parse("engine").numerics()):
        one = Model(w, nx)
        two = Model(w, nx, devices=["cpu", "cpu"])
        assert [str(two.device_of(i)) for i in range(w.cfg.n_layers)] == ["cpu"] * w.cfg.n_layers
        a, sa = one.extend(t, None, "all")
        b, sb = two.extend(t, None, "all")
        assert torch.equal(a, b)
        a, _ = one.extend(torch.tensor([7]), sa, "last")
        b, _ = two.extend(torch.tensor([7]), sb, "last")
        assert torch.equal(a, b)
    arms = [LockstepArm("golden", Numerics("reference"), role="golden"),
            LockstepArm("engine", ToggleSet.parse("engine").numerics())]
    ps = [Prompt("p", t)]
    x = pd.DataFrame(LockstepRunner(w, arms, RunnerSettings(decode_steps=1)).run(ps).drift)
    y = pd.DataFrame(LockstepRunner(w, arms, RunnerSettings(decode_steps=1, devices=("cpu", "cpu"))).run(ps).drift)
    pd.testing.assert_frame_equal(x, y, check_exact=True)


@pytest.mark.parametrize("cmd", [["ab", "--arm", "engine"], ["kld", "--arm", "g=golden"],
                                 ["serve"], ["needle", "--arm", "golden"]])
def test_commands_refuse_a_missing_device(cmd, capsys):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rc, msg = main([*cmd, "--devices", f"cuda:{n}"]), capsys.readouterr().err
    assert rc == 2 and f"cuda:{n} does not exist" in msg
