"""`fidelity kld`, `needle` and `serve` with --distributed (fidelity.pipeline.model,
torchrun + gloo on this CPU): the in-process golden arms run as a 2-rank pipeline and the
kld tables, the needle rows (answers and the indexer mechanism of layers on both ranks)
and the served completions (logprobs, a prefix-cache hit, the cache's byte accounting)
equal the single-process run's bit for bit; SIGTERM to torchrun stops every rank; an
exception on rank 1 is one error on rank 0 naming that rank; bad combinations are named
before any process group is formed."""
import gzip
import json
import os
import signal
import subprocess
import time
import sys
from pathlib import Path

import pytest

from fidelity.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed import HERE, ROOT, WAIT, _env, _port, _torchrun  # noqa: E402

KLD = ["--arm", "golden=golden", "--arm", "engine=engine", "--lengths", "200", "--depths", "50",
       "--reps", "1", "--decode-steps", "3", "--n-boot", "50"]
KLD_TABLES = ("capture_coverage.csv", "captures.csv", "kld_by_position.csv", "ladder.csv", "ladder_summary.csv",
              "positions.csv.gz", "signal_attribution.csv", "signal_summary.csv", "signals.csv.gz", "summary.md")


def _same_files(a: Path, b: Path, names) -> None:
    for name in names:
        x, y = (a / name).read_bytes(), (b / name).read_bytes()
        if name.endswith(".gz"):
            x, y = gzip.decompress(x), gzip.decompress(y)
        assert x == y, name


def test_kld_on_two_ranks_writes_the_single_process_tables(tmp_path):
    r = _torchrun(2, "-m", "fidelity", "kld", "--distributed", "2", *KLD, "--out", str(tmp_path / "d"),
                  "--run-id", "x")
    assert r.returncode == 0, r.stderr[-3000:]                  # flagged, said as 0 under torchrun
    assert "flagged (exit code 0 under torchrun" in r.stderr
    assert r.stdout.count("report:") == 1                       # rank 0 alone runs the command
    assert main(["kld", "--threads", "1", *KLD, "--out", str(tmp_path / "s"), "--run-id", "x"]) == 1
    _same_files(tmp_path / "s" / "kld" / "x", tmp_path / "d" / "kld" / "x", KLD_TABLES)


def test_kld_an_exception_on_rank_1_is_one_error_on_rank_0(tmp_path):
    r = _torchrun(2, "-m", "fidelity", "kld", "--plugin", str(HERE / "distributed" / "raise_plugin.py"),
                  "--distributed", "--arm", "golden=golden", "--arm", "bad=rank1_raises",
                  "--lengths", "200", "--depths", "50", "--reps", "1", "--decode-steps", "1", "--no-floors",
                  "--out", str(tmp_path))
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: rank 1 (layers 3-4) failed: RuntimeError: planted failure on rank 1"], r.stderr[-3000:]


def test_kld_distributed_needs_an_inprocess_arm(capsys, tmp_path):
    assert main(["kld", "--distributed", "--endpoint", "a=http://127.0.0.1:9", "--out", str(tmp_path)]) == 2
    assert "--distributed runs the in-process arms across the ranks" in capsys.readouterr().err


def test_kld_distributed_world_size_is_checked(monkeypatch, capsys, tmp_path):
    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    assert main(["kld", "--distributed", "3", "--arm", "g=golden", "--out", str(tmp_path)]) == 2
    assert "--distributed 3 ranks asked for, but torchrun started 2" in capsys.readouterr().err


def test_dense_weights_are_refused_under_distributed():
    from fidelity.pipeline.stage import DistributedError
    from fidelity.pipeline.model import stage_weights_mode
    with pytest.raises(DistributedError, match="loads every layer on every rank"):
        stage_weights_mode("dense")
    assert stage_weights_mode(None) == "streamed"


NEEDLE = ["--lengths", "383", "--depths", "25,75", "--no-plots"]


def _needle_rows(path: Path) -> list[dict]:
    """Result rows without what depends on the run (latency) or on batching (batch size)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if k not in ("latency_s", "batch_trials")} for r in rows
            if r.get("type") != "header"]
    return sorted(rows, key=lambda r: (r["arm"], r["trial_id"]))


def test_needle_on_two_ranks_gives_the_single_process_rows(tmp_path):
    r = _torchrun(2, "-m", "fidelity", "needle", "--distributed", *NEEDLE, "--out", str(tmp_path / "d"),
                  "--run-id", "x")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("report:") == 1
    assert main(["needle", "--threads", "1", *NEEDLE, "--out", str(tmp_path / "s"), "--run-id", "x"]) == 0
    got, want = (_needle_rows(tmp_path / d / "needle" / "results.jsonl") for d in "ds")
    assert len(want) == 4 and {r["arm"] for r in want} == {"golden", "engine"}
    assert {m["layer"] for m in want[0]["mechanism"]} == {1, 3}           # layer 3 runs on rank 1
    assert got == want


def test_needle_distributed_needs_an_inprocess_arm(capsys, tmp_path):
    assert main(["needle", "--distributed", "--endpoint", "a=http://127.0.0.1:9/v1", "--out", str(tmp_path)]) == 2
    assert "--distributed runs the in-process arms across the ranks" in capsys.readouterr().err


# ---- fidelity serve --distributed ---------------------------------------------------------
SERVE = ["--arm", "golden=golden", "--arm", "engine=engine", "--default-arm", "golden", "--page-size", "16"]


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc: torchrun's ranks)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _requests(url: str) -> list:
    """Completions with logprobs on both arms, a prefix-cache hit (the second prompt starts
    with the first's 40 tokens: 32 restored), an echo, a seeded sample; then the cache's stats."""
    import httpx
    prompt = list(range(5, 45))
    longer = prompt + list(range(100, 120))
    out = []
    for body in ({"model": "golden", "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 3},
                 {"model": "golden", "prompt": longer, "max_tokens": 4, "temperature": 0, "logprobs": 3},
                 {"model": "engine", "prompt": longer, "max_tokens": 3, "logprobs": 2, "echo": True,
                  "temperature": 0},
                 {"model": "engine", "prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0.7,
                  "seed": 3, "logprobs": 1}):
        r = httpx.post(url + "/v1/completions", json=body, timeout=WAIT)
        assert r.status_code == 200, r.text
        out.append({k: v for k, v in r.json().items() if k not in ("id", "created")})
    out.append(httpx.get(url + "/get_server_info", timeout=WAIT).json()["prefix_cache"])
    return out


def test_serve_on_two_ranks_answers_as_one_process_and_stops_on_sigterm():
    from needle_util import fidelity_cmd, free_port, stop, wait_healthy
    pd, ps = free_port(), free_port()
    dist = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(_port()), "-m", "fidelity",
                             "serve", "--distributed", "2", *SERVE, "--port", str(pd)],
                            cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    single = subprocess.Popen(fidelity_cmd("serve", *SERVE, "--threads", "1", "--port", str(ps)), cwd=ROOT,
                              env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_healthy(f"http://127.0.0.1:{pd}", dist, WAIT)
        wait_healthy(f"http://127.0.0.1:{ps}", single, WAIT)
        ranks = _children(dist.pid)
        got, want = _requests(f"http://127.0.0.1:{pd}"), _requests(f"http://127.0.0.1:{ps}")
        assert want[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        assert want[-1]["hits"] == 1 and want[-1]["stored"] > 0
        assert got == want
        assert len(ranks) == 2
        dist.send_signal(signal.SIGTERM)
        dist.wait(WAIT)                                   # a hang guard only
        t0 = time.monotonic()
        while not all(_gone(pid) for pid in ranks) and time.monotonic() - t0 < WAIT:   # a hang guard
            time.sleep(0.1)
        assert all(_gone(pid) for pid in ranks), "a rank outlived torchrun"
    finally:
        if dist.poll() is None:                           # a failed test: end what it started
            for pid in _children(dist.pid):
                os.kill(pid, signal.SIGKILL)
            dist.kill()
            dist.wait()
        stop([single])
        dist.stderr.close()


def test_each_call_carries_the_batch_mates_rank_0_sees():
    from fidelity.pipeline.calls import batch_mates
    from reference_model.schedule import co_batched
    assert batch_mates() == 0
    with co_batched(5):
        assert batch_mates() == 5


def test_kld_a_stage_without_enough_memory_is_named_with_the_plan(tmp_path):
    from test_distributed import _by_hand
    argv = ["kld", "--distributed", "--device-memory", "20MB", *KLD, "--out", str(tmp_path)]
    procs = _by_hand(2, argv, _port(), timeout=120)
    outs = [p.communicate(timeout=WAIT) for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    err = outs[0][1]
    assert err.count("error:") == 1 and "does not fit: it needs" in err and "of 0.02 GiB (weights" in err, err
    assert "for 1 prompt(s) x 5 arm(s) of 203 tokens; `fidelity plan-memory --nodes`" in err, err
    assert not list(tmp_path.rglob("summary.md"))


def test_the_per_prompt_commands_plan_the_head_on_rank_0():
    from fidelity.weights.plan import PassSpec, PlanDevices, plan_memory
    from reference_model import tiny
    last, first = (plan_memory(tiny(), PlanDevices("cpu,cpu", "1GB"), PassSpec(200, 1, 2, "streamed", head_first=h),
                               advise=False)
                   for h in (False, True))
    assert [d.layers for d in first.devices] == [d.layers for d in last.devices]     # the same split
    assert "head.weight" in first.devices[0].globals and "head.weight" not in first.devices[1].globals
    assert first.devices[0].logits == last.devices[1].logits > 0 == first.devices[1].logits
    cached = plan_memory(tiny(), PlanDevices("cpu,cpu", "1GB"), PassSpec(200, 1, 2, "streamed", cached_state=10**6),
                         advise=False)
    assert sum(d.state for d in cached.devices) - sum(d.state for d in last.devices) in range(10**6 - 2, 10**6 + 1)
