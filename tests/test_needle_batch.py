"""Needle trials batched layer-major (fidelity.needle_run.batch): a sweep run in batches gives
the rows of the one-at-a-time runner field by field (but latency), resident and streamed,
greedy and sampled; a streamed checkpoint reads each layer once per pass for the whole
batch; a failing trial drops out with the error row it gets alone; bounds and resume."""
import dataclasses
import json

import pytest

from fidelity.design.arms import parse_arm
from fidelity.cli import main
from fidelity.needle_run.batch import plan_batches
from fidelity.needle_run.runner import InProcessOptions, InProcessRunner
from fidelity.weights.target import Target, load_target
from needle.haystack import HaystackSpec, PromptFormat, build_prompt
from needle.sweep import SweepConfig, run_sweep
from reference_model.checkpoint_read import StreamingWeights
from reference_model.checkpoint_write import save_checkpoint
from reference_model.generate import Sampling

LENGTHS, DEPTHS = [200, 259], [0, 50, 100]
TIMING = {"latency_s", "batch_trials"}


@pytest.fixture(scope="module")
def target():
    return load_target()


@pytest.fixture(scope="module")
def checkpoint(target, tmp_path_factory):
    return save_checkpoint(target.weights, tmp_path_factory.mktemp("ckpt") / "tiny")


def _same_rows(a: list[dict], b: list[dict]) -> None:
    assert [r["trial_id"] for r in a] == [r["trial_id"] for r in b] and a
    for x, y in zip(a, b):
        assert set(x) - TIMING == set(y) - TIMING
        for k in set(x) - TIMING:
            assert x[k] == y[k], (k, x["trial_id"])


def _forwards(row) -> int:
    """Forward passes of one trial's generation: prefill + one per decode step (a stop id
    is picked after a forward; a full budget ends without one)."""
    return row["completion_tokens"] + (row["finish_reason"] == "stop")


def test_batched_sweep_equals_one_at_a_time_resident(target, tmp_path):
    cfg = SweepConfig(lengths=LENGTHS, depths=DEPTHS)
    one = run_sweep(cfg, [InProcessRunner("golden", target, parse_arm("golden"), options=InProcessOptions(batch=1))],
                    tmp_path / "one.jsonl", quiet=True)
    # batched, and resumed: a first run of two depths, then the rest of the grid
    path = tmp_path / "batched.jsonl"
    runner = InProcessRunner("golden", target, parse_arm("golden"))
    first = run_sweep(SweepConfig(lengths=LENGTHS, depths=[0, 100]), [runner], path, quiet=True)
    assert [r["batch_trials"] for r in first] == [2] * 4
    rows = run_sweep(cfg, [runner], path, quiet=True)
    logged = [json.loads(x) for x in path.read_text().splitlines()][1:]
    assert len(logged) == 6                             # the resumed run ran only the 2 missing
    assert [r["batch_trials"] for r in logged[4:]] == [1, 1]
    _same_rows(one, rows)
    assert len(rows) == 6
    assert all(r["mechanism"] and r["outcome"] != "server_error" for r in rows)


def test_batched_sampled_streamed_reads_each_layer_once_per_pass(target, checkpoint, tmp_path):
    n_layers = target.cfg.n_layers
    rows, loads = {}, {}
    for batch in (1, None):
        w = StreamingWeights(checkpoint)
        streamed = Target("tiny-streamed", w, target.tokenizer, "streamed")
        # hot sampling: trials end at different steps, so finished ones drop out mid-batch
        r = InProcessRunner("engine", streamed, parse_arm("engine"), Sampling(3.0, 0.95), 5,
                            InProcessOptions(batch=batch))
        rows[batch] = run_sweep(SweepConfig(lengths=LENGTHS, depths=[0, 100], seed=3), [r],
                                tmp_path / f"{batch}.jsonl", quiet=True)
        loads[batch] = w.loads
    _same_rows(rows[1], rows[None])
    assert len({_forwards(r) for r in rows[1]}) > 1       # the drop-out path ran
    # one at a time: every trial reads every layer for tokens[:-1], the last token and each
    # decode step; batched: once per pass (one batch per length), passes = its longest trial
    assert loads[1] == n_layers * sum(_forwards(r) + 1 for r in rows[1])
    per_length = {L: max(_forwards(r) for r in rows[None] if r["length"] == L) for L in LENGTHS}
    assert loads[None] == n_layers * sum(per_length.values())


def test_failing_trial_drops_out_with_its_own_error(target):
    runner = InProcessRunner("golden", target, parse_arm("golden"), max_tokens=3)
    good = [build_prompt(HaystackSpec(), PromptFormat(), runner.counter(), 200, d, 5) for d in (0, 100)]
    bad = dataclasses.replace(good[0], text="")           # no tokens: an InputError
    items = [(good[0], 1), (bad, 2), (good[1], 3)]
    got = {}
    runner.run_batch(items, lambda k, res: got.setdefault(k, res))
    assert sorted(got) == [0, 1, 2]
    assert "empty token sequence" in got[1]["error"]
    for k, (p, seed) in enumerate(items):
        alone = runner.run(p, seed)
        assert {a: v for a, v in got[k].items() if a not in TIMING} == \
               {a: v for a, v in alone.items() if a not in TIMING}


def test_plan_batches_bounds():
    assert plan_batches([10, 10, 10, 10]) == [[0, 1, 2, 3]]
    assert plan_batches([10, 10, 10, 10], max_trials=3) == [[0, 1, 2], [3]]
    assert plan_batches([10, 10, 10, 10], max_tokens=25) == [[0, 1], [2, 3]]
    assert plan_batches([30, 10, 10], max_tokens=25) == [[0], [1, 2]]       # too long: alone
    assert plan_batches([]) == []
    with pytest.raises(ValueError, match="max trials per batch must be at least 1"):
        plan_batches([1], max_trials=0)
    with pytest.raises(ValueError, match="max prompt tokens per batch"):
        plan_batches([1], max_tokens=0)


@pytest.mark.parametrize("opt", ["--batch", "--batch-tokens"])
def test_cli_refuses_a_bound_below_one(opt, tmp_path, capsys):
    assert main(["needle", opt, "0", "--out", str(tmp_path), "--no-plots"]) == 2
    assert f"{opt} must be at least 1, got 0" in capsys.readouterr().err
