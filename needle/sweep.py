"""A sweep: lengths x depths x repetitions, every trial run on every arm with the same
prompt (so arms pair up), rows appended to the results log as they finish, finished
(arm, trial) pairs skipped on resume. A runner that takes batches (`arun_batch`) is
handed every pending trial of one length at once.

Prompts are sized by the first arm's counter (in-process tokenizer, or the first
endpoint's /tokenize, or a calibration against it); all arms then get identical text."""
from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from . import haystack as H
from .http import HttpRunner
from .results import ResultsLog, latest
from .scoring import contains_value, leaked_specials, score


def residue_lengths(base: list[int]) -> list[int]:
    """Lengths around powers of two that cover every residue mod 4 and sit on both sides
    of a 128 boundary: for each b, b-1 (3 mod 4, 127 mod 128 if b % 128 == 0), b, b+1, b+2."""
    out = []
    for b in base:
        out += [b - 1, b, b + 1, b + 2]
    return sorted(set(out))


@dataclass(frozen=True)
class Trial:
    length: int
    depth: float
    rep: int
    trial_id: str
    seed: int


@dataclass
class SweepConfig:
    lengths: list[int]
    depths: list[float]
    reps: int = 1
    spec: H.HaystackSpec = field(default_factory=H.HaystackSpec)
    fmt: H.PromptFormat = field(default_factory=H.PromptFormat)
    seed: int = 0
    # more depths at some lengths only (the boundary grid's needle just inside / outside
    # the sliding window, fidelity.design.lengths.needle_window_depths): {length: (depth, ...)}
    length_depths: dict = field(default_factory=dict)

    def trial_settings(self, count_source: str) -> dict:
        """What makes trials comparable across runs (checked on resume)."""
        return {"spec": self.spec.to_dict(), "format": self.fmt.to_dict(), "seed": self.seed,
                "count_source": count_source}

    def plan(self) -> list[Trial]:
        out = []
        for L in self.lengths:
            extra = [d for d in self.length_depths.get(L, ()) if d not in self.depths]
            for d in [*self.depths, *extra]:
                for r in range(self.reps):
                    key = [self.spec.to_dict(), self.fmt.to_dict(), self.seed, L, float(d), r]
                    tid = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
                    out.append(Trial(L, float(d), r, tid, H.trial_seed(key)))
        return out


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def build_prompts(cfg: SweepConfig, trials: list[Trial], counter, quiet=False) -> dict[str, H.Prompt]:
    if getattr(counter, "a", 0) is None:                      # CalibratedCounter, not yet fitted
        counter.calibrate(*H.probe_prompts(cfg.spec, cfg.fmt, cfg.seed))
        _log(f"token counts calibrated from usage.prompt_tokens: {counter.a:.1f} + "
             f"{counter.b:.4f} * chars (not exact; residuals are reported)", quiet)
    out, hint = {}, {}                     # hint: tokens per word, carried prompt to prompt
    for t in trials:
        out[t.trial_id] = H.build_prompt(cfg.spec, cfg.fmt, counter, t.length, t.depth, t.seed, hint)
    return out


def make_row(trial: Trial, prompt: H.Prompt, runner, res: dict, cfg: SweepConfig) -> dict:
    sc = score(prompt.expected, res.get("response"), res.get("finish_reason"), res.get("error"),
               prompt.distractors, cfg.spec.value_type, prompt.keys + prompt.distractor_keys)
    reported = res.get("prompt_tokens")
    row = {
        "trial_id": trial.trial_id, "arm": runner.name, "runner": runner.kind,
        "arm_detail": runner.detail,
        "length": trial.length, "depth": trial.depth, "rep": trial.rep,
        "kind": cfg.spec.kind, "distractor_mode": cfg.spec.distractors,
        "value_type": cfg.spec.value_type, "filler": cfg.spec.filler,
        "mode": cfg.fmt.mode, "thinking": cfg.fmt.thinking,
        "n_tokens": prompt.n_tokens, "exact_length": prompt.exact,
        "count_source": prompt.count_source, "prompt_tokens_reported": reported,
        "token_residual": (reported - trial.length) if isinstance(reported, int) else None,
        "depth_chars": prompt.depth_chars, "needle_depths": prompt.needle_depths,
        "prompt_sha256": prompt.sha256, "key": prompt.key, "keys": prompt.keys,
        "expected": prompt.expected, "distractor_keys": prompt.distractor_keys,
        "distractors": prompt.distractors,
        "outcome": sc.outcome, "found": sc.found, "recall": sc.recall,
        "value_in_reasoning": bool(res.get("reasoning_content")) and any(
            contains_value(res["reasoning_content"], v) for v in prompt.expected),
    }
    specials = leaked_specials(res)
    if specials:                                     # BOS in a reply: a NaN logits row's argmax
        row["specials"] = specials
    if isinstance(runner, HttpRunner):               # endpoint arms: asked for / answered by
        row["model_requested"] = runner.model
    for k in ("model", "response", "reasoning_content", "finish_reason", "completion_tokens", "latency_s",
              "attempts", "error", "error_status", "errors", "mechanism", "value_token_positions",
              "batch_trials"):
        if k in res:
            row[k] = res[k]
    return row


async def _execute(cfg, jobs, prompts, runners, log: ResultsLog, quiet: bool,
                   interrupted: threading.Event | None = None):
    """Each runner works through its own jobs: a runner with `arun_batch` gets every pending
    trial of one length at once (in-process: run layer-major, fidelity.needle_run.batch),
    others `concurrency` trials at a time through `arun`. Rows are appended as each trial
    finishes either way, so a resumed run skips exactly the finished trials."""
    total, done = len(jobs), 0
    mine = {r.name: [t for t, j in jobs if j is r] for r in runners}

    def record(t, r, res):
        nonlocal done
        row = make_row(t, prompts[t.trial_id], r, res, cfg)
        log.append(row)
        done += 1
        _log(f"[{done}/{total}] {r.name:>12} L={t.length} depth={t.depth:g} rep={t.rep}: "
             f"{row['outcome']} ({row.get('latency_s', 0):.2f}s"
             f"{', ' + str(row['attempts']) + ' attempts' if row.get('attempts', 1) > 1 else ''}"
             f"{', batch of ' + str(row['batch_trials']) if row.get('batch_trials', 1) > 1 else ''})",
             quiet)

    stop = interrupted or threading.Event()

    async def worker(r, q):
        while not stop.is_set():
            try:
                t = q.get_nowait()
            except asyncio.QueueEmpty:
                return
            record(t, r, await r.arun(prompts[t.trial_id], t.seed))

    async def batches(r, trials):
        by_length: dict[int, list[Trial]] = {}
        for t in trials:
            by_length.setdefault(t.length, []).append(t)
        for group in by_length.values():
            async for k, res in r.arun_batch([(prompts[t.trial_id], t.seed) for t in group]):
                record(group[k], r, res)
                if stop.is_set():
                    return

    tasks = []
    for r in runners:
        if hasattr(r, "arun_batch"):
            tasks.append(batches(r, mine[r.name]))
            continue
        q = asyncio.Queue()
        for t in mine[r.name]:
            q.put_nowait(t)
        tasks += [worker(r, q) for _ in range(r.concurrency)]
    for r in runners:
        await r.aopen()
    try:
        await asyncio.gather(*tasks)
    finally:
        for r in runners:
            await r.aclose()


def _run_interruptible(make_coro) -> None:
    """asyncio.run(make_coro(stop)) where Ctrl-C always ends the sweep with KeyboardInterrupt.
    asyncio's own SIGINT handling cancels the task and relies on the cancellation reaching
    the top; one loaded CI run saw it lost and the sweep (and the runs after it) go on to
    the end. Here SIGINT also sets `stop`, which the workers check between trials, and the
    interrupt is raised after the loop whatever became of the cancellation. Finished rows
    are already in the log (append-only), so a rerun resumes."""
    stop = threading.Event()

    async def guarded():
        loop, task = asyncio.get_running_loop(), asyncio.current_task()

        def on_sigint():
            stop.set()
            task.cancel()
        try:
            loop.add_signal_handler(signal.SIGINT, on_sigint)
        except (ValueError, RuntimeError, NotImplementedError):    # not the main thread
            pass
        try:
            await make_coro(stop)
        finally:
            try:
                loop.remove_signal_handler(signal.SIGINT)
            except (ValueError, RuntimeError, NotImplementedError):
                pass
    try:
        asyncio.run(guarded())
    except asyncio.CancelledError:
        if not stop.is_set():
            raise
    if stop.is_set():
        raise KeyboardInterrupt


def run_sweep(cfg: SweepConfig, runners: list, results_path, fresh: bool = False,
              quiet: bool = False) -> list[dict]:
    """Run every pending (trial, arm); returns the latest row of every (arm, trial) in the
    log (including rows from earlier runs)."""
    names = [r.name for r in runners]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must be unique, got {names}")
    for r in runners:                               # each endpoint arm's own model, before the header
        getattr(r, "discover_model", lambda: None)()
    counter = runners[0].counter()
    try:
        header = {"trials": cfg.trial_settings(counter.source),
                  "arms": [r.describe() for r in runners]}
        log = ResultsLog(results_path, header, fresh=fresh)
        plan = cfg.plan()
        finished = log.done()
        jobs = [(t, r) for t in plan for r in runners if (r.name, t.trial_id) not in finished]
        skipped = len(plan) * len(runners) - len(jobs)
        _log(f"sweep: {len(plan)} trials x {len(runners)} arms; {skipped} already done, "
             f"{len(jobs)} to run -> {results_path}", quiet)
        if jobs:
            need = {t.trial_id: t for t, _ in jobs}
            t0 = time.perf_counter()
            prompts = build_prompts(cfg, list(need.values()), counter, quiet)
            _log(f"built {len(prompts)} prompts ({counter.source}) in "
                 f"{time.perf_counter() - t0:.1f}s", quiet)
    finally:
        getattr(counter, "close", lambda: None)()
    if jobs:
        _run_interruptible(lambda stop: _execute(cfg, jobs, prompts, runners, log, quiet, stop))
    order = {n: i for i, n in enumerate(names)}
    pos = {t.trial_id: i for i, t in enumerate(plan)}
    return sorted(latest(log.rows), key=lambda r: (order.get(r["arm"], len(order)),
                                                   pos.get(r["trial_id"], len(pos)), r["trial_id"]))
