"""The per-token tail (fidelity/verdict/spikes.py): positions far beyond the floors at that
same position, counted per prompt. By hand on a small table, then a whole `fidelity kld` with
a planted rare-token bug (examples/plugins/rare_token.py): named by its spikes while its mean
KLD stays inside the floors; a copy that never fires is not named."""
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fidelity.cli import main
from fidelity.verdict.spikes import SPIKE, spike_shares

PLUGIN = str(Path(__file__).resolve().parents[1] / "examples" / "plugins" / "rare_token.py")


def _positions(values: dict[str, list[float]], prompts=("a", "b")) -> pd.DataFrame:
    rows = []
    for arm, vals in values.items():
        for i, v in enumerate(vals):
            rows.append({"arm": arm, "prompt": prompts[i % len(prompts)], "position": i // len(prompts),
                         "phase": "prefill", "kl_lb": v})
    return pd.DataFrame(rows)


def test_a_spike_is_judged_against_the_floors_at_its_own_position():
    f1 = [1e-6, 1e-6, 1e-6, 1e-2, 1e-6, 1e-6, 1e-6, 1e-6]      # position 1 of prompt b: floors are large
    f2 = [2e-6, 1e-6, 1e-6, 1e-3, 1e-6, 1e-6, 1e-6, 1e-6]
    arm = [5e-3, 1e-6, 1e-6, 5.0, 1e-6, 1e-6, 1e-6, float("nan")]
    t = spike_shares(_positions({"f1": f1, "f2": f2, "x": arm}), ["f1", "f2"]).set_index(["arm", "prompt"])
    # prompt a: position 0 is 5e-3 >= 1000 x 2e-6 -> a spike; prompt b: 5.0 vs 1000 x 1e-2 -> none,
    # and a NaN (the nonfinite signal's) is never one
    assert t.loc[("x", "a"), "spikes"] == 1 and t.loc[("x", "a"), "value"] == 0.25
    assert t.loc[("x", "b"), "spikes"] == 0 and t.loc[("x", "b"), "positions"] == 3
    # each floor against the other floor: f1's 1e-2 is 10x f2's 1e-3 there, no spike
    assert t.loc[("f1", "b"), "spikes"] == 0 and t.loc[("f2", "a"), "spikes"] == 0
    assert spike_shares(_positions({"x": arm}), ["f1"]).empty            # no floor, no signal
    lone = spike_shares(_positions({"f": [1e-6, 1e-6, 1e-6, 5e-2]}, ("a",)), ["f"]).set_index("arm")
    assert lone.loc["f", "spikes"] == 1                 # a lone floor against its own run median
    assert SPIKE == 1000


@pytest.mark.slow          # ~30 s on 2 cores: make test-slow (CI runs it)
def test_kld_names_a_rare_wrong_token_that_the_mean_averages_away(tmp_path, capsys):
    rc = main(["kld", "--arm", "golden=golden", "--arm", "rare=rare_token_swap(period=200,shift=3)",
               "--arm", "never=rare_token_swap(period=1000000000)", "--plugin", PLUGIN,
               "--lengths", "256", "--reps", "6", "--decode-steps", "1", "--no-captures",
               "--out", str(tmp_path), "--run-id", "r", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 1, out
    m = json.loads((tmp_path / "kld" / "r" / "manifest.json").read_text())
    named = {n["toggle"]: n["signals"] for n in m["verdict"]["named"]}
    assert list(named) == ["rare"], named                     # `never` is not named
    assert "kl_spikes" in named["rare"] and "kld_mean" not in named["rare"], named
    assert m["verdict"]["named"][0]["signal"] == "kl_spikes"     # the lead: its spikes
    assert "of its positions have a KLD at least 1000x" in out
    s = pd.read_csv(tmp_path / "kld" / "r" / "signals.csv.gz")
    never = s[(s.arm == "never") & (s.signal == "kl_spikes")]
    assert len(never) == 18 and np.all(never.value == 0)
