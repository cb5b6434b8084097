"""Helpers for the needle/server tests: free loopback ports and real `fidelity serve`
subprocesses (started and stopped by pid)."""
import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fidelity_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "fidelity.cli", *args]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 900.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server at {url} not healthy after {timeout}s")


@contextlib.contextmanager
def served(*arms: str, extra=()):
    """`fidelity serve` subprocesses, one per arm (given by $DSV4_FIDELITY_ARM), on free
    loopback ports, started together; yields their root URLs."""
    procs = []
    try:
        for arm in arms or ("golden",):
            port = free_port()
            env = {**os.environ, "DSV4_FIDELITY_ARM": arm}
            procs.append((f"http://127.0.0.1:{port}", subprocess.Popen(
                fidelity_cmd("serve", "--port", str(port), *extra), cwd=ROOT, env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
        for url, proc in procs:
            wait_healthy(url, proc)
        yield [url for url, _ in procs]
    finally:
        stop([proc for _, proc in procs])


def stop(procs) -> None:
    """SIGTERM every server, then wait (SIGKILL after 15 s) and close its stderr."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def ok(r) -> dict:
    """The JSON of a 200 answer; anything else fails with the server's text."""
    assert r.status_code == 200, r.text
    return r.json()


def kld_exit(report: Path) -> int:
    """The exit code a kld run must have given for the verdict its report holds
    (fidelity.errors: 1 when flagged, 0 when not)."""
    import json
    from fidelity.errors import exit_code
    from fidelity.kld.twin import flagged
    return exit_code(flagged(json.loads((Path(report) / "manifest.json").read_text())["verdict"]))
