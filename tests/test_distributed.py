"""The golden across processes (fidelity.pipeline, torchrun + gloo on this CPU): 2 and 3
pipeline ranks give the single-process tables bit for bit (drift, KLD, pairs, needle
picks; and through `fidelity ab`, the verdict and first divergences), for streamed and
resident-quantised weights, each rank reading only its layers; a rank dying mid-run is
one clear error on rank 0 and no process is left behind; an unreachable rank 0, a world
size other than the one asked for, more ranks than layers are named errors."""
import gzip
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from fidelity.ab.lockstep import LockstepRunner, RunnerSettings
from fidelity.cli import main
from fidelity.pipeline.stage import stage_ranges
from fidelity.weights.source import load_weights
from reference_model import random_weights, tiny
from reference_model.checkpoint import save_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from distributed.cases import arms, prompts, tables  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parent
WAIT = 900                  # a bound against hangs only: the runs take well under a minute


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "FIDELITY_DIST_BACKEND": "gloo"}


def _torchrun(n: int, *argv) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
           "--master-addr", "127.0.0.1", "--master-port", str(_port()), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=WAIT, cwd=ROOT)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dist") / "ck"
    save_checkpoint(random_weights(tiny(), seed=4), path)
    return path


def test_three_ranks_equal_one_process_streamed_and_resident(checkpoint, tmp_path):
    out = tmp_path / "got.pkl"
    r = _torchrun(3, str(HERE / "distributed" / "lockstep_worker.py"), str(checkpoint), str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    got = pickle.loads(out.read_bytes())
    w, _ = load_weights(str(checkpoint), mode="streamed")
    want = tables(LockstepRunner(w, arms(), RunnerSettings(decode_steps=2), {"bug": "engine"}).run(prompts()))
    assert len(want["drift"]) > 100 and len(want["needle"]) and len(want["pair_kld"])
    for mode in ("streamed", "resident-quantised"):
        for k, v in want.items():
            pd.testing.assert_frame_equal(v, got[mode][k], check_exact=True)
    ranges = [range(a, b) for a, b in got["ranges"]]
    assert ranges == stage_ranges(tiny(), 3) and [len(x) for x in ranges] == [2, 2, 1]
    assert got["layers_read"] == [list(x) for x in ranges]          # each rank read its own layers


AB = ["--lengths", "250", "--reps", "3", "--decode-steps", "1", "--arm", "index_keys_fp8",
      "--arm", "engine", "--shapley-top", "0", "--n-boot", "200"]
TABLES = ("drift.csv.gz", "kld.csv.gz", "pairs.csv.gz", "needle.csv", "signals.csv.gz", "summary.csv",
          "signal_summary.csv", "attribution.csv", "events.csv", "summary.md")


def test_fidelity_ab_on_two_ranks_writes_the_single_process_report(tmp_path):
    r = _torchrun(2, "-m", "fidelity", "ab", "--distributed", "2", *AB, "--out", str(tmp_path / "d"),
                  "--run-id", "x")
    assert r.returncode == 0, r.stderr[-3000:]
    assert main(["ab", "--threads", "1", *AB, "--out", str(tmp_path / "s"), "--run-id", "x"]) == 0
    for name in TABLES:
        a, b = ((tmp_path / d / "x" / name).read_bytes() for d in "sd")
        if name.endswith(".gz"):
            a, b = gzip.decompress(a), gzip.decompress(b)
        assert a == b, name
    assert "index_keys_fp8 changes indexer selection" in (tmp_path / "d" / "x" / "summary.md").read_text()
    assert r.stdout.count("report:") == 1                    # rank 0 alone prints and writes


def _by_hand(n: int, argv, port: int, timeout: float) -> list[subprocess.Popen]:
    """n ranks started without torchrun's agent (nothing else stops the survivors)."""
    procs = []
    for k in range(n):
        env = {**_env(), "WORLD_SIZE": str(n), "RANK": str(k), "LOCAL_RANK": str(k),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "fidelity", *argv, "--dist-timeout", str(timeout)],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs


def test_a_rank_dying_mid_run_is_one_clear_error_on_rank_0(tmp_path):
    argv = ["ab", "--plugin", str(HERE / "distributed" / "die_plugin.py"), "--distributed", "2",
            "--lengths", "200", "--reps", "1", "--decode-steps", "1", "--arm", "rank1_dies",
            "--shapley-top", "0", "--out", str(tmp_path)]
    procs = _by_hand(2, argv, _port(), timeout=120)
    outs = [p.communicate(timeout=WAIT) for p in procs]             # both end: nothing hangs
    assert [p.returncode for p in procs] == [2, 3]
    err = outs[0][1]
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert "rank 0 (layers 0-2) lost contact with rank 1 (layers 3-4)" in err, err
    assert not list(tmp_path.rglob("summary.md"))                    # no report from a broken run


def test_a_stage_without_enough_memory_is_named_with_the_plan(tmp_path):
    argv = ["ab", "--distributed", "--device-memory", "20MB", "--lengths", "200", "--reps", "1",
            "--arm", "engine", "--out", str(tmp_path)]
    procs = _by_hand(2, argv, _port(), timeout=120)
    outs = [p.communicate(timeout=WAIT) for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    err = outs[0][1]
    assert err.count("error:") == 1 and "does not fit: it needs" in err and "of 0.02 GiB (weights" in err, err
    assert "for 1 prompt(s) x 5 arm(s) of 204 tokens; `fidelity plan-memory --nodes`" in err, err


def test_rank_0_unreachable_within_the_timeout_is_named(tmp_path):
    port = _port()                                                   # nobody listens there
    env = {**_env(), "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    r = subprocess.run([sys.executable, "-m", "fidelity", "ab", "--distributed", "--dist-timeout", "3",
                        "--out", str(tmp_path)], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=WAIT)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"rank 1: could not join the process group at 127.0.0.1:{port} within 3 s" in r.stderr


@pytest.mark.parametrize("world,asked,msg", [
    ("2", "3", "--distributed 3 ranks asked for, but torchrun started 2 (WORLD_SIZE=2)"),
    ("9", None, "9 ranks for 5 layers: every stage needs at least one layer; use at most 5 ranks"),
    ("1", None, "--distributed needs at least 2 ranks, torchrun started 1"),
])
def test_world_size_errors(world, asked, msg, monkeypatch, capsys, tmp_path):
    for k, v in {"WORLD_SIZE": world, "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    argv = ["ab", "--distributed"] + ([asked] if asked else []) + ["--out", str(tmp_path)]
    assert main(argv) == 2
    assert msg in capsys.readouterr().err


def test_not_launched_by_torchrun(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["ab", "--distributed", "--out", str(tmp_path)]) == 2
    assert "launch with e.g. `torchrun --nproc-per-node 2 -m fidelity ab --distributed" in capsys.readouterr().err
