"""`fidelity engines` with real `fidelity serve` processes as the engines: three arms set
through their environment (DSV4_FIDELITY_ARM, as a real engine's env vars), KLD + needle,
attribution naming the planted bug, no arm process left (also after Ctrl-C), resume
without relaunching, start-up failures named (exit during start, never ready, port in
use before anything is launched, tokenizer mismatch), and start-up logged sparsely with
the probe's answer in words.

No assertion depends on how fast this machine is: timeouts are either hang guards far
above any start-up seen (HANG), or the timeout under test runs against a server that was
already listening before the wait began."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from infra.server_process import EngineProcess, LaunchError, LaunchPlan, ReadinessLog

from needle_util import ROOT, fidelity_cmd, free_port, served

HANG = 900              # seconds: a guard against a hung run, never a speed requirement

SPEC = """
[run]
baseline = "golden"
tasks = {tasks}
out = "{out}"
[run.kld]
lengths = [250, 511]
depths = [30, 70]
steps = 4
n_boot = 300
{kld_extra}
[run.needle]
lengths = [259, 300]
depths = [0, 100]
max_tokens = 12
api = "completions"
temperature = 0

[engines.fs]
kind = "fidelity"
port = {port}
start_timeout = {timeout}
stop_grace = 5
flags = {flags}
{engine_extra}

[[arms]]
name = "golden"
engine = "fs"
toggles = "golden"

[[arms]]
name = "engine"
engine = "fs"
toggles = "engine"

[[arms]]
name = "engine-bug"
engine = "fs"
toggles = "engine,routed_scaling_double"
"""


def _spec(tmp_path, tasks='["kld", "needle"]', flags="[]", timeout=HANG, kld_extra="", engine_extra="",
          port=None):
    port = port or free_port()
    p = tmp_path / "spec.toml"
    p.write_text(SPEC.format(tasks=tasks, out=tmp_path / "out", port=port, timeout=timeout, flags=flags,
                             kld_extra=kld_extra, engine_extra=engine_extra))
    return p, port


def _run(spec, *extra, timeout=3 * HANG):
    return subprocess.run(fidelity_cmd("engines", "run", str(spec), *extra), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                   # a zombie is not a running engine
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _state(tmp_path, out="out") -> dict:
    return json.loads((tmp_path / out / "engines" / "spec" / "state.json").read_text())


WAITING = re.compile(r"^(\S+): waiting for the engine \((\d+) s\): GET (\S+) -> (.+)$")
EXPLAINED = ("connection refused (nothing listening on the port yet)", "(up, not ready yet)",
             "(the server is busy", "(the server is starting)", "(the server has no such route")


def _check_sparse(stderr: str) -> None:
    """Every start-up line names its status in words and says something new: a changed
    status, or the same one 30 s later."""
    last = {}
    for line in stderr.splitlines():
        m = WAITING.match(line)
        if not m:
            continue
        arm, t, status = m.group(1), int(m.group(2)), m.group(4)
        assert any(e in status for e in EXPLAINED), line
        if arm in last:
            t0, s0 = last[arm]
            assert status != s0 or t - t0 >= 29, f"repeated start-up line: {line}"
        last[arm] = (t, status)


def test_three_arms_kld_and_needle_name_the_bug(tmp_path):
    spec, port = _spec(tmp_path)
    p = _run(spec)
    assert p.returncode == 1, p.stderr[-3000:]              # flagged: the bug arm
    assert "routed_scaling_double breaks coherence" in p.stdout
    st = _state(tmp_path)
    runs = st.pop("run log")                                                # the run's order of events
    assert [(e["event"], e["arm"]) for e in runs[0]["events"]][:2] == [("launched", "golden"), ("stopped", "golden")]
    assert set(st) == {"golden", "engine", "engine-bug"}
    for arm, s in st.items():
        assert s["done"] == ["kld", "needle"] and not _alive(s["pid"])       # stopped, by PID
        assert s["engine"]["server_info"]["arms"]                            # the engine's own view
    assert "routed_scaling_double" in st["engine-bug"]["engine"]["server_info"]["arms"]["tiny-needle"]["toggles"]
    root = tmp_path / "out" / "engines" / "spec"
    m = json.loads((root / "kld-report" / "manifest.json").read_text())
    named = {n["toggle"]: n for n in m["verdict"]["named"]}
    assert m["verdict"]["culprit"] == "routed_scaling_double"
    assert named["routed_scaling_double"]["lo"] > named["routed_scaling_double"]["floor_hi"]
    assert named["routed_scaling_double"]["method"] == "leave_one_out"
    summary = (root / "summary.md").read_text()
    assert "needle recall" in summary and (root / "needle" / "needle-report" / "index.html").exists()
    assert (root / "index.html").read_text().count("data:image/png;base64,") == 2    # both lead plots
    assert (root / "logs" / "engine.log").exists() and (root / "launch.sh").stat().st_mode & 0o100
    # start-up logged sparsely and in words; every arm stopped by our SIGTERM
    _check_sparse(p.stderr)
    assert p.stderr.count("stopped (ended by SIGTERM)") + p.stderr.count("stopped (exit code 0)") == 3
    # rerun: nothing is launched again, the same verdict
    p2 = _run(spec)
    assert p2.returncode == 1 and p2.stderr.count("not launched") == 3
    assert json.loads((root / "kld-report" / "manifest.json").read_text())["verdict"] == m["verdict"]


def test_ctrl_c_stops_the_engine(tmp_path):
    spec, port = _spec(tmp_path, tasks='["needle"]')
    spec.write_text(spec.read_text().replace("max_tokens = 12", "max_tokens = 12\nreps = 50"))
    proc = subprocess.Popen(fidelity_cmd("engines", "run", str(spec)), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + HANG
        pid = None
        while time.monotonic() < end:
            try:
                pid = _state(tmp_path)["golden"].get("pid")
            except (OSError, ValueError, KeyError):
                pid = None
            if pid and (tmp_path / "out" / "engines" / "spec" / "needle" / "golden.jsonl").exists():
                break
            time.sleep(0.2)
        assert pid and _alive(pid)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=HANG)      # reading the pipes: a full pipe cannot block it
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, f"exit code {proc.returncode}; stderr ends:\n{err[-3000:]}"
    assert not _alive(pid)
    assert _state(tmp_path)["golden"]["stopped"]["exit_code"] is not None


def test_engine_exiting_during_start_is_named(tmp_path):
    spec, _ = _spec(tmp_path, flags='["--no-such-flag"]')
    p = _run(spec)
    assert p.returncode == 2
    assert "exited with code 2 before it was ready" in p.stderr and "--no-such-flag" in p.stderr


def test_never_ready_times_out(tmp_path):
    """Through the CLI, with --out overriding the spec's out. Whether the stand-in was
    listening within the 3 s depends on the machine, so either explained status is
    right; the exact HTTP status is checked below against a server already listening."""
    spec, _ = _spec(tmp_path, timeout=3, engine_extra='ready = "/not-a-route"')
    p = _run(spec, "--out", str(tmp_path / "elsewhere"))
    assert p.returncode == 2
    m = re.search(r"not ready after 3 s \(GET /not-a-route: (.+?)\); last log lines", p.stderr)
    assert m and (m.group(1).startswith("HTTP 404") or m.group(1).startswith("connection refused")), p.stderr
    assert not _alive(_state(tmp_path, "elsewhere")["golden"]["pid"])
    assert not (tmp_path / "out").exists()                     # --out won over the spec's out


def _plan(tmp_path, port, cmd, ready="/not-a-route", timeout=1.0):
    return LaunchPlan("a", "e", "fidelity", f"http://127.0.0.1:{port}", cmd, {}, ready, timeout, 5.0)


def _listening(port: int, proc) -> None:
    end = time.monotonic() + HANG
    while time.monotonic() < end and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"server on {port} never listened (exit {proc.poll()})")


def test_timeout_names_the_servers_answer(tmp_path):
    """A real server process (python -m http.server: 404 on the probe) listening before the
    wait begins, so its answer is known whatever the machine's speed."""
    port = free_port()
    e = EngineProcess(_plan(tmp_path, port, [sys.executable, "-m", "http.server", str(port), "--bind",
                                             "127.0.0.1", "--directory", str(tmp_path)]), tmp_path / "a.log")
    e.start()
    try:
        _listening(port, e.proc)
        seen = []
        with pytest.raises(LaunchError) as ex:
            e.wait_ready(poll=4.0, progress=lambda w, st: seen.append(st))
    finally:
        e.stop()
    msg = str(ex.value)
    assert "arm a: not ready after 1 s (GET /not-a-route: HTTP 404" in msg
    assert "the server has no such route: check `ready` in the engine's spec" in msg
    assert seen and all(st.startswith("HTTP 404") for st in seen)
    assert not _alive(e.pid)


def test_nothing_listening_is_connection_refused(tmp_path):
    port = free_port()
    e = EngineProcess(_plan(tmp_path, port, [sys.executable, "-c", "import time; time.sleep(3600)"]),
                      tmp_path / "a.log")
    e.start()
    with pytest.raises(LaunchError) as ex:
        e.wait_ready(poll=0.5)
    assert "(GET /not-a-route: connection refused (nothing listening on the port yet))" in str(ex.value)
    assert not _alive(e.pid)


def test_readiness_log_is_sparse():
    """A line when the status changes, else one per 30 s: 10 minutes of polling every
    second with three statuses gives 3 + 20 lines, not 600."""
    lines = []
    log = ReadinessLog(lines.append, "a", "/health")
    for t in range(600):
        log(float(t), "refused" if t < 100 else "HTTP 503 x" if t < 400 else "refused")
    got = [(int(re.search(r"\((\d+) s\)", ln).group(1)), ln.rsplit("-> ", 1)[1]) for ln in lines]
    want = ([(t, "refused") for t in range(0, 100, 30)] + [(t, "HTTP 503 x") for t in range(100, 400, 30)]
            + [(t, "refused") for t in range(400, 600, 30)])
    assert got == want and lines[0] == "a: waiting for the engine (0 s): GET /health -> refused"


def test_port_in_use_is_named_before_launching(tmp_path):
    """A real server (an arm that was not stopped) on the port: the run says so and
    launches nothing: no 'launching', no 'stopped', no pid."""
    with served("golden") as (url,):
        port = int(url.rsplit(":", 1)[1])
        spec, _ = _spec(tmp_path, port=port)
        p = _run(spec)
    assert p.returncode == 2
    assert (f"port {port} on 127.0.0.1 is already in use (a process is listening on it: another server, "
            "or an arm that was not stopped); nothing was launched") in p.stderr
    assert "golden: launching" not in p.stderr and "golden: stopped (" not in p.stderr
    assert "Traceback" not in p.stderr
    state = tmp_path / "out" / "engines" / "spec" / "state.json"
    assert not state.exists() or "pid" not in json.loads(state.read_text()).get("golden", {})


def test_port_bound_but_not_listening_is_named(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))                  # held, not listening: the engine could not bind
        spec, port = _spec(tmp_path, port=s.getsockname()[1])
        p = _run(spec)
    assert p.returncode == 2 and f"port {port} on 127.0.0.1 is already in use (it cannot be bound" in p.stderr
    assert "golden: launching" not in p.stderr


def test_tokenizer_mismatch_is_named(tmp_path):
    from reference_model.tokenizer import build_tokenizer_json
    other = tmp_path / "other.json"
    other.write_text(build_tokenizer_json("the river runs under the old stone bridge " * 40, 300))
    spec, _ = _spec(tmp_path, tasks='["kld"]', kld_extra=f'tokenizer = "{other}"')
    spec.write_text(spec.read_text().replace("lengths = [250, 511]", "lengths = [1500]"))
    p = _run(spec)
    assert p.returncode == 2 and "tokenizer differs from ours" in p.stderr
    assert not _alive(_state(tmp_path)["golden"]["pid"])
