"""DeepSeek-V4.1 under --distributed (fidelity.pipeline): its layers read other layers'
state (KV, index and candidate sources), so stages are cut only where no later layer
reads an earlier stage's state, balanced on weight bytes among those cuts; plan-memory
--nodes plans the same cuts; a world size the cuts cannot meet names the largest one; a
read across the cuts (a toggle) is an error, never an empty cache, and the sequence's
last index-key writer travels with the streams; and a 2-rank tiny V4.1
gives the single-process `fidelity ab` and `fidelity kld` tables bit for bit."""
import copy
import sys
from pathlib import Path

import pytest

from fidelity.cli import main
from fidelity.pipeline.stage import StageStateError, carried, carry_in, stage_state
from fidelity.weights.stages import segments, stage_ranges
from fidelity.weights.plan import PassSpec, PlanDevices, PlanError, plan_memory
from reference_model import flash
from reference_model.v41.config import tiny_v41, v41_flash

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed import AB, TABLES, _torchrun  # noqa: E402
from test_distributed_commands import KLD_TABLES, _same_files  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint():
    from fidelity.weights.source import resolve_checkpoint
    return resolve_checkpoint("tiny-v41")          # the embedded tiny V4.1 checkpoint


def test_stages_are_cut_only_where_no_layer_reads_an_earlier_stage():
    assert [s.start for s in segments(tiny_v41())] == [0, 1, 2, 4, 6]      # 3 reads 2, 5 reads 4, 7-9 read 6
    assert stage_ranges(tiny_v41(), 2) == [range(0, 4), range(4, 10)]
    assert stage_ranges(v41_flash(), 6)[-1] == range(20, 40)                 # 20-39 read KV source 20
    with pytest.raises(ValueError, match="can be cut only before layers 1, 2, 8, 14, 20: at most 6 stages; "
                                           "use at most 6 ranks"):
        stage_ranges(v41_flash(), 7)


def test_plan_memory_nodes_plans_the_stages_that_run():
    for cfg, n in ((v41_flash(), 3), (flash(), 8)):
        plan = plan_memory(cfg, PlanDevices("cuda:0,cuda:1", "1000GB", n // 2 or 1),
                           PassSpec(4096, weights_mode="resident-quantised"), advise=False)
        assert [d.layers for d in plan.devices] == [list(r) for r in stage_ranges(cfg, len(plan.devices))]
    with pytest.raises(PlanError, match="at most 6 ranks"):
        plan_memory(v41_flash(), PlanDevices("cuda:0,cuda:1,cuda:2,cuda:3", "96GB", 2), PassSpec(4096))


def test_a_read_across_the_cuts_is_an_error_naming_the_layer():
    from reference_model.v41.model import ModelV41
    from reference_model.v41.weights import random_weights
    model = ModelV41(random_weights(tiny_v41(), 0))
    stage = type("S", (), {"layers": range(0, 4)})()
    state = stage_state(model, stage)
    assert state.layers[3].index_keys is None and copy.deepcopy(state).layers[6] is state.layers[6]
    with pytest.raises(StageStateError, match="layer 6's state is on another pipeline stage"):
        state.layers[6].index_keys
    carry_in(state, {"key_writer": 6})                 # what travels with the streams
    assert carried(state) == {"key_writer": 6}


def test_a_world_the_cuts_cannot_meet_is_named(checkpoint, monkeypatch, capsys, tmp_path):
    for k, v in {"WORLD_SIZE": "6", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    assert main(["ab", "--distributed", "--checkpoint", str(checkpoint), "--out", str(tmp_path)]) == 2
    assert "at most 5 stages; use at most 5 ranks" in capsys.readouterr().err


AB41 = ["--lengths", "60", "--reps", "1", "--decode-steps", "1", "--arm", "engine",
        "--shapley-top", "0", "--n-boot", "50"]


def test_ab_on_two_ranks_writes_the_single_process_tables(checkpoint, tmp_path):
    argv = ["--checkpoint", str(checkpoint), *AB41, "--run-id", "x"]
    r = _torchrun(2, "-m", "fidelity", "ab", "--distributed", "2", *argv, "--out", str(tmp_path / "d"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert main(["ab", "--threads", "1", *argv, "--out", str(tmp_path / "s")]) == 0
    _same_files(tmp_path / "s" / "x", tmp_path / "d" / "x", TABLES)


KLD41 = ["--arm", "golden=golden", "--arm", "engine=engine", "--lengths", "200", "--depths", "50",
         "--reps", "1", "--decode-steps", "2", "--n-boot", "50", "--no-floors", "--no-captures"]


def test_kld_on_two_ranks_writes_the_single_process_tables(checkpoint, tmp_path):
    argv = ["--checkpoint", str(checkpoint), *KLD41, "--run-id", "x"]
    r = _torchrun(2, "-m", "fidelity", "kld", "--distributed", "2", *argv, "--out", str(tmp_path / "d"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert main(["kld", "--threads", "1", *argv, "--out", str(tmp_path / "s")]) == 1     # engine named
    _same_files(tmp_path / "s" / "kld" / "x", tmp_path / "d" / "kld" / "x",
                [n for n in KLD_TABLES if n not in ("captures.csv", "capture_coverage.csv")])
