"""A server as a child process: started in its own session with its output in a log file,
ready when its readiness path answers 200 within a timeout (a process that exits first is a
failure at once, with its log's last lines), and its whole process group stopped (SIGTERM,
then SIGKILL after a grace period) however the run ends. What `fidelity engines` launches
(fidelity/engines/launch.py makes the plan) and what the llama.cpp and mlx-vlm modules
start their own servers with."""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

LOG_TAIL = 20


class LaunchError(RuntimeError):
    pass


@dataclass
class LaunchPlan:
    arm: str
    engine: str
    kind: str
    url: str
    cmd: list[str] = field(default_factory=list)           # empty for external
    env: dict[str, str] = field(default_factory=dict)      # only what the plan sets
    ready_path: str = "/health"
    start_timeout: float = 3600.0
    stop_grace: float = 30.0
    notes: list[str] = field(default_factory=list)

    def shell(self) -> str:
        """The same launch as a shell command line."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + " ".join(shlex.quote(c) for c in self.cmd)


def port_busy(host: str, port: int) -> str | None:
    """Why an engine could not bind host:port, or None when it can: something answers
    connections there, or a socket holds the port without listening. Binding with
    SO_REUSEADDR, as servers do, so the previous arm's TIME_WAIT connections do not count."""
    with socket.socket() as s:
        s.settimeout(0.5)
        if s.connect_ex((host, port)) == 0:
            return "a process is listening on it"
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as ex:
            return f"it cannot be bound ({ex.strerror or ex})"
    return None


def probe_status(response=None, error: Exception | None = None, timeout: float = 5.0) -> str:
    """A readiness probe's answer in words: what a start-up log reader needs to know."""
    if error is not None:
        if isinstance(error, httpx.ConnectError):
            return "connection refused (nothing listening on the port yet)"
        if isinstance(error, httpx.TimeoutException):
            return f"no answer within {timeout:.0f} s (the server is busy, e.g. loading weights)"
        if isinstance(error, (httpx.RemoteProtocolError, httpx.ReadError)):
            return "connection closed without an answer (the server is starting)"
        return f"{type(error).__name__}: {error}"
    code, why = response.status_code, response.reason_phrase
    if code == 404:
        return (f"HTTP 404 {why} (the server has no such route: check `ready` in the engine's "
                "spec)")
    if code == 503:
        return f"HTTP 503 {why} (up, not ready yet)"
    if code >= 500:
        return f"HTTP {code} {why} (up, the readiness check fails)"
    return f"HTTP {code} {why}"


class ReadinessLog:
    """Sparse start-up logging: a line when the probe's answer changes, else one every
    `every` seconds (an engine can take many minutes to load)."""

    def __init__(self, log, arm: str, path: str, every: float = 30.0):
        self.log, self.arm, self.path, self.every = log, arm, path, every
        self.last, self.at = None, 0.0

    def __call__(self, waited: float, status: str) -> None:
        if status != self.last or waited - self.at >= self.every:
            self.log(f"{self.arm}: waiting for the engine ({waited:.0f} s): GET {self.path} -> {status}")
            self.last, self.at = status, waited


class EngineProcess:
    """One launched arm: start() in its own session, wait_ready(), stop() the group."""

    def __init__(self, plan: LaunchPlan, log_path: Path, cwd: Path | None = None):
        self.plan, self.log_path, self.cwd = plan, Path(log_path), cwd
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def check_port(self) -> None:
        """LaunchError, before anything is started, when the arm's port is taken."""
        u = urlsplit(self.plan.url)
        why = port_busy(u.hostname, u.port)
        if why:
            raise LaunchError(f"arm {self.plan.arm}: port {u.port} on {u.hostname} is already in use ({why}: "
                              f"another server, or an arm that was not stopped); nothing was launched. "
                              f"Stop that process or give engine {self.plan.engine} another port")

    def start(self) -> None:
        self.check_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.plan.cmd, env={**os.environ, **self.plan.env}, cwd=self.cwd,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        except OSError as ex:
            raise LaunchError(f"arm {self.plan.arm}: cannot start {self.plan.cmd[0]}: {ex}") from None
        finally:
            log.close()

    def tail(self, n: int = LOG_TAIL) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + ln for ln in lines[-n:])

    def wait_ready(self, poll: float = 1.0, progress=None) -> float:
        """Seconds until the readiness probe answered 200; LaunchError if the process exits
        first (exit code + last log lines) or the timeout passes. `progress(waited, status)`
        after every unready probe, the status in words (probe_status)."""
        t0 = time.monotonic()
        url = self.plan.url.rstrip("/") + self.plan.ready_path
        last = "no answer yet"
        timeout = max(5.0, poll * 5)
        with httpx.Client(timeout=timeout) as c:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise LaunchError(f"arm {self.plan.arm}: the engine exited with code {code} "
                                      f"before it was ready; last log lines ({self.log_path}):\n{self.tail()}")
                try:
                    r = c.get(url)
                    if r.status_code == 200:
                        return time.monotonic() - t0
                    last = probe_status(r)
                except httpx.HTTPError as ex:
                    last = probe_status(error=ex, timeout=timeout)
                waited = time.monotonic() - t0
                if waited > self.plan.start_timeout:
                    self.stop()
                    raise LaunchError(f"arm {self.plan.arm}: not ready after {self.plan.start_timeout:.0f} s "
                                      f"(GET {self.plan.ready_path}: {last}); last log lines "
                                      f"({self.log_path}):\n{self.tail()}")
                if progress:
                    progress(waited, last)
                time.sleep(poll)

    def stop(self) -> int | None:
        """SIGTERM to the whole process group (workers included, even if the leader has
        already exited), SIGKILL after the grace period; the leader's exit code."""
        if self.proc is None:
            return None
        pgid = self.proc.pid                     # start_new_session: the group is the leader's pid
        _signal_group(pgid, signal.SIGTERM)
        end = time.monotonic() + self.plan.stop_grace
        while time.monotonic() < end and _group_alive(pgid):
            self.proc.poll()
            time.sleep(0.05)
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)
        return self.proc.wait()


@contextlib.contextmanager
def running(plan: LaunchPlan, log: Path, poll: float = 0.25, fail=lambda e: e):
    """`plan` started with this start's output alone in `log`, ready, its URL yielded; stopped
    however the block ends. A start that fails stops the process and raises fail(LaunchError)
    (the error names its exit code or timeout and the log's last lines)."""
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"")
    proc = EngineProcess(plan, log)
    try:
        proc.start()
        proc.wait_ready(poll=poll)
    except LaunchError as e:
        proc.stop()
        raise fail(e) from None
    try:
        yield plan.url
    finally:
        proc.stop()


def describe_exit(code: int | None) -> str:
    """An exit status in words: a negative code is the signal that ended the process."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"ended by {signal.Signals(-code).name}"
        except ValueError:
            return f"ended by signal {-code}"
    return f"exit code {code}"


def _signal_group(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True

