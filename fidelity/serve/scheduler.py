"""One worker thread owns the model and runs requests' forwards (a prompt, then one token
at a time) in turns: a request runs until it finishes or has used a time slice (default
1 s of compute) while others wait, then goes to the back of the line. Requests that fit
in a slice finish in arrival order (as under a lock); a long one cannot hold the model
for more than a slice, so a short request behind it is answered; a request whose client
went away is dropped before its next step. Requests are interleaved, not batched: the
golden forward is one sequence, and a batched forward would change reduction shapes, so
served answers would no longer equal the in-process golden bit for bit. What an engine's
batch-dependent kernel would see is kept: a step runs with the tokens the other requests
on the same model would bring to it (their prompt, or one token while decoding) as its
batch-mates (reference_model.schedule.co_batched), which only such kernels read. The
number of requests in the server is bounded; beyond it `submit` raises Busy (the server
answers 429 with Retry-After)."""
from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque

from reference_model.schedule import co_batched


class Busy(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"server busy; retry after {retry_after} s")
        self.retry_after = retry_after


class ClientGone(Exception):
    """The client disconnected before its request finished."""


class Job:
    """A request's Decoder and the asyncio queue its events go to: ("token", id),
    ("done", None), ("error", exc), ("cancelled", None)."""

    def __init__(self, decoder, loop: asyncio.AbstractEventLoop):
        self.decoder, self.loop = decoder, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.finished = asyncio.Event()            # set with done / error / cancelled
        self.error: Exception | None = None
        self.cancelled = False
        self.compute = 0.0                          # seconds of forwards so far
        self.steps_at_cancel: int | None = None

    def cancel(self) -> None:
        if not self.cancelled:
            self.steps_at_cancel = self.decoder.steps
            self.cancelled = True

    def emit(self, kind: str, value=None) -> None:
        """From the worker thread: queue the event on the request's event loop."""
        self.loop.call_soon_threadsafe(self._deliver, kind, value)

    def _deliver(self, kind: str, value) -> None:
        self.events.put_nowait((kind, value))
        if kind != "token":
            self.error = value if kind == "error" else None
            self.finished.set()


class Scheduler:
    def __init__(self, max_jobs: int = 256, time_slice: float = 1.0):
        if max_jobs < 1 or time_slice < 0:
            raise ValueError("max_jobs must be >= 1 and time_slice >= 0")
        self.max_jobs, self.time_slice = max_jobs, time_slice
        self._jobs: deque[Job] = deque()
        self._running: Job | None = None
        self._cv = threading.Condition()
        self.stats = {"submitted": 0, "completed": 0, "cancelled": 0, "failed": 0, "refused": 0,
                      "steps": 0, "step_seconds": 0.0, "job_seconds": 0.0,
                      "cancel_lag_steps_max": 0}
        threading.Thread(target=self._work, name="fidelity-serve-model", daemon=True).start()

    def load(self) -> int:
        """Requests in the server: queued plus the one being stepped."""
        with self._cv:
            return len(self._jobs) + (self._running is not None)

    def submit(self, job: Job) -> None:
        with self._cv:
            if len(self._jobs) + (self._running is not None) >= self.max_jobs:
                self.stats["refused"] += 1
                raise Busy(self._retry_after())
            self.stats["submitted"] += 1
            self._jobs.append(job)
            self._cv.notify()

    def _retry_after(self) -> int:
        """Seconds until a slot is likely free: the queue ahead, each job taking the mean
        finished job's compute, or at most one slice before it rotates."""
        per_job = self.stats["job_seconds"] / max(self.stats["completed"], 1) or self.time_slice
        return max(1, math.ceil(min(per_job, self.time_slice) * len(self._jobs)))

    def snapshot(self) -> dict:
        with self._cv:
            s = dict(self.stats)
            s["active"] = len(self._jobs) + (self._running is not None)
            s["max_jobs"], s["time_slice_s"] = self.max_jobs, self.time_slice
        s["step_seconds_mean"] = s.pop("step_seconds") / max(s["steps"], 1)
        s["job_seconds_mean"] = s.pop("job_seconds") / max(s["completed"], 1)
        return s

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                job = self._running = self._jobs.popleft()
            self._turn(job)
            with self._cv:
                self._running = None
                if not job.decoder.done:
                    self._jobs.append(job)              # back of the line

    def _turn(self, job: Job) -> None:
        """Steps of one job until it is done or cancelled, or it has used its time slice
        while others wait (a step is never split)."""
        used = 0.0
        while not job.decoder.done:
            if job.cancelled:
                self._drop(job)
                return
            used += self._step(job)
            with self._cv:
                others = bool(self._jobs)
            if others and used >= self.time_slice:
                return

    def _drop(self, job: Job) -> None:
        """A cancelled job leaves; how many steps ran after the cancel is recorded."""
        job.decoder.done = True
        lag = job.decoder.steps - job.steps_at_cancel
        self.stats["cancelled"] += 1
        self.stats["cancel_lag_steps_max"] = max(self.stats["cancel_lag_steps_max"], lag)
        job.emit("cancelled")

    def _mates(self, job: Job) -> int:
        """Tokens the other live requests on the job's model bring to this step."""
        with self._cv:
            others = [j for j in self._jobs if not j.cancelled]
        return sum(j.decoder.next_tokens() for j in others if j.decoder.model is job.decoder.model)

    def _step(self, job: Job) -> float:
        """One forward of the job; its seconds."""
        t0 = time.perf_counter()
        before = len(job.decoder.out.tokens)
        try:
            with co_batched(self._mates(job)):
                job.decoder.step()
        except Exception as e:              # reported to the request, the server goes on
            self.stats["failed"] += 1
            job.decoder.done = True
            job.emit("error", e)
            return time.perf_counter() - t0
        dt = time.perf_counter() - t0
        job.compute += dt
        self.stats["steps"] += 1
        self.stats["step_seconds"] += dt
        for tok in job.decoder.out.tokens[before:]:       # a speculative step makes several
            job.emit("token", tok)
        if job.decoder.done:
            self.stats["completed"] += 1
            self.stats["job_seconds"] += job.compute
            job.emit("done")
        return dt


async def wait_done(job: Job, is_disconnected) -> None:
    """Until the job is done; if the client goes away first, cancel it and raise ClientGone.
    `is_disconnected` is the request's coroutine function (polled every 50 ms)."""
    while not job.finished.is_set():
        try:
            await asyncio.wait_for(job.finished.wait(), 0.05)
        except asyncio.TimeoutError:
            if await is_disconnected():
                job.cancel()
                raise ClientGone() from None
    if job.error is not None:
        raise job.error


async def token_events(job: Job):
    """Each new token id as it is made, then returns when done; cancels the job if the
    consumer stops early (a streaming client that disconnected)."""
    try:
        while True:
            kind, value = await job.events.get()
            if kind == "token":
                yield value
            elif kind == "done":
                return
            elif kind == "error":
                raise value
    finally:
        if not job.decoder.done:
            job.cancel()
