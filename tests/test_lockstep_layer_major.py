"""Layer-major lockstep: running several prompts through each layer together gives the
same tables, bit for bit, as running them one at a time; spilling residual streams to
disk changes nothing; a streamed checkpoint's layers are fetched once per pass, not once
per prompt."""
import pandas as pd
import pytest
import torch

from fidelity.ab.lockstep import LockstepArm, LockstepRunner, Prompt, RunnerSettings, StreamStore
from kernel_toggles import ToggleSet
from reference_model import Numerics, tiny
from reference_model.checkpoint import StreamingWeights, save_checkpoint
from reference_model.weights import random_weights


def _arms():
    return [LockstepArm("golden", Numerics("reference"), role="golden"),
            LockstepArm("engine", ToggleSet.parse("engine").numerics(), frozenset({"engine"})),
            LockstepArm("bug", ToggleSet.parse("engine,routed_scaling_double").numerics(), frozenset({"b"}))]


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [Prompt(f"p{j}", torch.randint(2, 500, (n,), generator=g), needle_tokens=(3, 4) if j else ())
            for j, n in enumerate((70, 133, 41))]


def _tables(res):
    return {k: pd.DataFrame(getattr(res, k)) for k in ("drift", "kld", "pairs", "pair_kld", "needle", "events")}


@pytest.fixture(scope="module")
def weights():
    return random_weights(tiny(), seed=1)


def test_layer_major_equals_one_prompt_at_a_time(weights):
    pairs = {"bug": "engine"}
    together = LockstepRunner(weights, _arms(), RunnerSettings(decode_steps=2), pairs).run(_prompts())
    alone = None
    for p in _prompts():
        r = LockstepRunner(weights, _arms(), RunnerSettings(decode_steps=2), pairs).run([p])
        if alone is None:
            alone = r
        else:
            alone.extend(r)
    a, b = _tables(together), _tables(alone)
    assert len(a["drift"]) > 100 and len(a["needle"]) > 0
    for k in a:
        pd.testing.assert_frame_equal(a[k], b[k], check_exact=True)


def test_spilling_streams_to_disk_changes_nothing(weights):
    ref = LockstepRunner(weights, _arms(), RunnerSettings(decode_steps=1)).run(_prompts())
    runner = LockstepRunner(weights, _arms(), RunnerSettings(decode_steps=1, activation_budget=0))
    spilled = runner.run(_prompts())
    assert runner.streams.spilled > 0 and runner.streams.dir is None        # used, then removed
    for k, v in _tables(ref).items():
        pd.testing.assert_frame_equal(v, _tables(spilled)[k], check_exact=True)


def test_stream_store_budget():
    s = StreamStore(budget=4 * 10)
    s.put("a", {"g": torch.zeros(10)})                                       # 40 bytes: in memory
    s.put("b", {"g": torch.ones(10)})                                        # over budget: disk
    assert s.spilled == 1 and "a" in s.mem
    assert torch.equal(s.get("b")["g"], torch.ones(10)) and torch.equal(s.get("a")["g"], torch.zeros(10))
    s.clear()


def test_streamed_checkpoint_layers_fetched_once_per_pass(tmp_path, weights):
    save_checkpoint(weights, tmp_path / "ck")
    w = StreamingWeights(tmp_path / "ck")
    LockstepRunner(w, _arms(), RunnerSettings(decode_steps=1)).run(_prompts())
    n = weights.cfg.n_layers
    assert w.loads == 2 * n                       # prefill + 1 decode step, for all 3 prompts
