"""`fidelity engines` with real `fidelity serve` processes as the engines: three arms set
through their environment (DSV4_FIDELITY_ARM, as a real engine's env vars), KLD + needle,
attribution naming the planted bug, no arm process left (also after Ctrl-C), resume
without relaunching, and start-up failures named (exit during start, never ready, port in
use, tokenizer mismatch)."""
import json
import os
import signal
import socket
import subprocess
import time


from needle_util import ROOT, fidelity_cmd, free_port

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


def _spec(tmp_path, tasks='["kld", "needle"]', flags="[]", timeout=120, kld_extra="", engine_extra="",
          port=None):
    port = port or free_port()
    p = tmp_path / "spec.toml"
    p.write_text(SPEC.format(tasks=tasks, out=tmp_path / "out", port=port, timeout=timeout, flags=flags,
                             kld_extra=kld_extra, engine_extra=engine_extra))
    return p, port


def _run(spec, *extra, timeout=600):
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


def _state(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "engines" / "spec" / "state.json").read_text())


def test_three_arms_kld_and_needle_name_the_bug(tmp_path):
    spec, port = _spec(tmp_path)
    p = _run(spec)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "routed_scaling_double breaks coherence" in p.stdout
    st = _state(tmp_path)
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
    assert (root / "logs" / "engine.log").exists() and (root / "launch.sh").stat().st_mode & 0o100
    # rerun: nothing is launched again, the same verdict
    p2 = _run(spec)
    assert p2.returncode == 0 and p2.stderr.count("not launched") == 3
    assert json.loads((root / "kld-report" / "manifest.json").read_text())["verdict"] == m["verdict"]


def test_ctrl_c_stops_the_engine(tmp_path):
    spec, port = _spec(tmp_path, tasks='["needle"]')
    spec.write_text(spec.read_text().replace("max_tokens = 12", "max_tokens = 12\nreps = 50"))
    proc = subprocess.Popen(fidelity_cmd("engines", "run", str(spec)), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 120
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
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 130
    assert not _alive(pid)
    assert _state(tmp_path)["golden"]["stopped"]["exit_code"] is not None


def test_engine_exiting_during_start_is_named(tmp_path):
    spec, _ = _spec(tmp_path, flags='["--no-such-flag"]')
    p = _run(spec)
    assert p.returncode == 2
    assert "exited with code 2 before it was ready" in p.stderr and "--no-such-flag" in p.stderr


def test_never_ready_times_out(tmp_path):
    spec, _ = _spec(tmp_path, timeout=3, engine_extra='ready = "/not-a-route"')
    p = _run(spec)
    assert p.returncode == 2
    assert "not ready after 3 s (GET /not-a-route: HTTP 404)" in p.stderr
    assert not _alive(_state(tmp_path)["golden"]["pid"])


def test_port_in_use_is_named(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        spec, port = _spec(tmp_path, port=s.getsockname()[1])
        p = _run(spec)
    assert p.returncode == 2 and f"port {port} on 127.0.0.1 is already in use" in p.stderr


def test_tokenizer_mismatch_is_named(tmp_path):
    from reference_model.tokenizer import build_tokenizer_json
    other = tmp_path / "other.json"
    other.write_text(build_tokenizer_json("the river runs under the old stone bridge " * 40, 300))
    spec, _ = _spec(tmp_path, tasks='["kld"]', kld_extra=f'tokenizer = "{other}"')
    spec.write_text(spec.read_text().replace("lengths = [250, 511]", "lengths = [1500]"))
    p = _run(spec)
    assert p.returncode == 2 and "tokenizer differs from ours" in p.stderr
    assert not _alive(_state(tmp_path)["golden"]["pid"])
