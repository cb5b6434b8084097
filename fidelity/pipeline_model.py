"""The golden's Model API across pipeline ranks, for commands that call the model one
prompt or request at a time (`fidelity kld`, `needle`, `serve`): a driver/worker split
over the stages of fidelity.pipeline.

Rank 0 runs the command as one process does, with `PipelineModel`s in place of Models.
Every `extend` is one call: rank 0 broadcasts a small command (model key, state handle,
token ids, phase, tap patterns), embeds, runs its own layers and sends the residual
streams to rank 1; each rank runs its contiguous layers on its own part of the state and
sends them on; the last rank sends the final streams (all rows for 'all'/'hidden', the
last row for 'last', none for 'none') and its ranks' taps back to rank 0, which runs the
head. So rank 0 holds the embedding and the head; the streams cross every boundary once
per call and come back once. States live with their stage under the handle's id; a
handle rank 0 drops is freed on every rank with the next call; copying, restoring or
chunk-bounding a state (serve's prefix cache) is a call that every rank does to its part.

Ranks > 0 run `work` until rank 0 says stop. An exception on a worker travels down the
pipeline in place of the streams and is raised on rank 0 as one StageError naming the
rank; a rank that dies or hangs is the Stage's DistributedError (process-group timeout).
Models are built on every rank from a picklable recipe (a module-level function and its
arguments returning the Numerics), since a Numerics with replaced kernels does not pickle."""
from __future__ import annotations

import datetime
import itertools
import sys
import threading
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from reference_model import build_model
from reference_model.schedule import ONESHOT, batch_tokens, co_batched, in_step

from .pipeline import DistributedError, carried, carry_in, stage_state


class StageError(RuntimeError):
    """A call failed on another rank: the message names it (the command's error)."""


@dataclass
class _Recipe:
    numerics: tuple                      # (module-level function, *args) -> Numerics
    schedule: object = ONESHOT
    chunk_tokens: int = 2048
    record_index_scores: bool = False    # return each index_scores result (needle's mechanism)

    def build(self, weights, devices, cache: dict, record=None):
        """The Model; with record_index_scores, `record(scores)` gets each index_scores result."""
        fn, *args = self.numerics
        nx = fn(*args)
        if self.record_index_scores:
            def recorder(golden, q, keys, w):
                s = golden.index_scores(q, keys, w)
                record(s.detach().cpu())
                return s
            nx = nx.with_kernels("index-score-recorder", index_scores=recorder)
        return build_model(weights, nx, chunk_tokens=self.chunk_tokens, devices=devices,
                           schedule=self.schedule, weight_cache=cache)


CALL_WAIT = datetime.timedelta(days=30)      # a worker waits for rank 0's next call this long


def calls_group():
    """The group rank 0's calls are broadcast in (every rank joins it, in the same order):
    gloo, with no practical timeout, since rank 0 may be busy elsewhere (an endpoint arm)
    or idle between calls. A dead rank 0 still ends the wait: its connections close."""
    return dist.new_group(backend="gloo", timeout=CALL_WAIT)


def arm_numerics(spec: str, profile: str = "reference", numerics_kwargs: dict | None = None,
                 model: str = "v4"):
    """An arm's Numerics from its spelling (fidelity.arms; `engine` as for a `model`
    checkpoint): a recipe every rank can rebuild."""
    from fidelity.arms import parse_arm
    return parse_arm(spec, model).numerics(profile, **(numerics_kwargs or {}))


def stage_devices(stage) -> list | None:
    """A rank's model devices: its GPU, or None (CPU as given)."""
    return [stage.device] if stage.device.type == "cuda" else None


@dataclass(eq=False)
class PipelineState:
    """A handle on one sequence's state: rank 0's layers' part here, the rest on its ranks.
    A deep copy (the serve prefix cache's snapshot) copies it on every rank."""
    id: int
    local: object                       # rank 0's SequenceState (only its layers are filled)
    model: "PipelineModel" = field(repr=False, compare=False, default=None)

    def __deepcopy__(self, memo) -> "PipelineState":
        return self.model.state_op("copy", self)

    def all_ranks_bytes(self) -> int:
        """Tensor bytes of this state on every rank (the prefix cache's budget)."""
        return self.model.state_op("bytes", self)

    @property
    def pos(self) -> int:
        return self.local.pos

    @pos.setter
    def pos(self, v: int) -> None:
        self.local.pos = v


class Driver:
    """Rank 0's side: builds PipelineModels and sends every call down the pipeline."""

    def __init__(self, stage, weights=None):
        """Made right after init_stage (joining the calls' group is collective); `weights`
        (this stage's) may be set later, before the first model."""
        self.stage, self.weights = stage, weights
        self.group = calls_group()
        self.devices = stage_devices(stage)
        self._cache: dict = {}
        self._keys = itertools.count()
        self._ids = itertools.count()
        self._freed: list[int] = []                # handles dropped since the last call
        self._freed_lock = threading.RLock()        # a finalizer may run inside _send
        self.lock = threading.RLock()              # one call down the pipeline at a time
        self.calls = 0
        self.bytes_out = 0                         # stream bytes rank 0 sent / got back
        self.bytes_back = 0

    def model(self, numerics: tuple, schedule=ONESHOT, chunk_tokens: int = 2048,
              record=None) -> "PipelineModel":
        """A model on every rank: `numerics` is (module-level function, *args) returning its
        Numerics; `record(scores)`, if given, gets every index_scores result of its calls,
        in layer order, whichever rank computed it (needle's mechanism)."""
        recipe = _Recipe(numerics, schedule, chunk_tokens, record is not None)
        with self.lock:
            key = next(self._keys)
            self._send({"op": "model", "key": key, "recipe": recipe})
        return PipelineModel(self, key, recipe, record)

    def free(self, state_id: int) -> None:
        """A handle rank 0 no longer holds: its state goes on every rank with the next call."""
        with self._freed_lock:
            self._freed.append(state_id)

    def _send(self, cmd: dict) -> None:
        with self._freed_lock:
            cmd["free"], self._freed = self._freed, []
        self.stage.from_first(cmd, f"its next call ({cmd['op']})", self.group)

    def stop(self) -> None:
        """Every worker leaves its loop; a worker already gone is no new error. Says on
        stderr what rank 0's calls moved."""
        try:
            with self.lock:
                self._send({"op": "stop"})
        except DistributedError:
            pass
        if self.calls:
            mib = lambda b: f"{b / 2**20:.1f} MiB"          # noqa: E731
            print(f"pipeline: {self.calls} calls; rank 0 sent {mib(self.bytes_out)} of residual streams to "
                  f"rank 1 and got {mib(self.bytes_back)} back", file=sys.stderr)


class PipelineModel:
    """The subset of Model's API the per-prompt commands use, run across the pipeline:
    new_state, check_tokens, extend, embed and head (rank 0 holds the embedding and head)."""

    def __init__(self, driver: Driver, key: int, recipe: _Recipe, record=None):
        self.driver, self.key, self.record = driver, key, record
        self.local = recipe.build(driver.weights, driver.devices, driver._cache, record)
        self.cfg, self.nx, self.chunk_tokens = self.local.cfg, self.local.nx, self.local.chunk_tokens
        self.schedule = self.local.schedule

    def new_state(self) -> PipelineState:
        return self._handle(stage_state(self.local, self.driver.stage))

    def _handle(self, local) -> PipelineState:
        st = PipelineState(next(self.driver._ids), local, self)
        weakref.finalize(st, self.driver.free, st.id)
        return st

    def restore_state(self, stored: PipelineState) -> PipelineState:
        """A new state from a stored one through this arm's `state_restore`, every rank."""
        return self.state_op("restore", stored)

    def chunk_boundary_state(self, state: PipelineState) -> PipelineState:
        """This arm's `chunk_boundary` on the state's layers, every rank (in place)."""
        return self.state_op("boundary", state)

    def state_op(self, op: str, state: PipelineState):
        """copy / restore (a new handle), boundary (the same), bytes (summed over ranks): every
        rank does it to its layers' part; a worker's error is raised here."""
        with self.driver.lock:
            new = next(self.driver._ids) if op in ("copy", "restore") else None
            self.driver._send({"op": "state", "what": op, "key": self.key, "state": state.id, "new": new})
            try:
                mine = _state_op(self.local, self.driver.stage.layers, op, state.local)
                err = None
            except Exception as e:
                mine, err = None, e
            replies = self.driver.stage.gather(None, f"the other ranks' {op} of a state")
        if err is not None:
            raise err
        bad = [r for r in replies[1:] if isinstance(r, str)]
        if bad:
            raise StageError(bad[0])
        if op == "bytes":
            return mine + sum(replies[1:])
        if op == "boundary":
            return state
        st = PipelineState(new, mine, self)
        weakref.finalize(st, self.driver.free, st.id)
        return st

    def check_tokens(self, tokens, state: PipelineState) -> torch.Tensor:
        return self.local.check_tokens(tokens, state.local)

    def embed(self, tokens, taps=None):
        return self.local.embed(tokens, taps)

    def head(self, H, taps=None):
        return self.local.head(H, taps)

    def extend(self, tokens, state: PipelineState | None = None, logits: str = "last", taps=None,
               phase: str | None = None):
        """Model.extend across the ranks (module docstring); returns (logits, state)."""
        with self.driver.lock:
            return self._extend(tokens, state, logits, taps, phase)

    def _extend(self, tokens, state, logits, taps, phase):
        state = state or self.new_state()
        tokens = self.local.check_tokens(tokens, state.local)
        if phase is None:
            phase = "decode" if state.pos > 0 and tokens.numel() == 1 else "prefill"
        d, st = self.driver, self.driver.stage
        rows = {"hidden": "all", "all": "all", "none": "none"}.get(logits, "last")
        d._send({"op": "extend", "key": self.key, "state": state.id, "tokens": tokens.cpu(), "phase": phase,
                 "taps": taps.patterns if taps else None, "latest": taps.latest if taps else [],
                 "rows": rows, "mates": _batch_mates()})
        d.calls += 1
        try:
            H = self.local.embed(tokens, taps)
            for i in st.layers:
                H = self.local.layer(i, H, tokens, state.local, taps, phase)
        except Exception as e:
            st.send_streams({"error": None, "failed": True}, [], "a failed call")
            st.recv_streams("the end of a failed call", peer=st.world - 1)
            raise e
        st.send_streams({"error": None, "carried": carried(state.local)}, [H], "the call's streams")
        d.bytes_out += H.numel() * H.element_size()
        meta, back = st.recv_streams("the call's final streams", peer=st.world - 1)
        if meta["error"]:
            raise StageError(meta["error"])
        carry_in(state.local, meta["carried"])
        for s in meta["scores"]:
            self.record(s)
        if taps is not None:
            for name, part in meta["taps"]:
                taps.put(name, part)
        state.pos += tokens.numel()
        d.bytes_back += sum(t.numel() * t.element_size() for t in back)
        if logits == "none":
            return None, state
        H = back[0]
        if logits == "hidden":
            return H, state
        return self.local.head(H if logits == "all" else H[-1:], taps), state


@dataclass
class _Worker:
    stage: object
    weights: object
    models: dict = field(default_factory=dict)
    scores: dict = field(default_factory=dict)       # model key -> its recorder's sink
    states: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)
    broken: dict = field(default_factory=dict)       # model key -> why it could not be built

    def build(self, key, recipe: _Recipe) -> None:
        self.scores[key] = sink = []
        try:
            self.models[key] = recipe.build(self.weights, stage_devices(self.stage), self.cache, sink.append)
        except Exception as e:                        # said on rank 0 at the model's first call
            self.broken[key] = f"{type(e).__name__}: {e}"

    def extend(self, cmd) -> None:
        st = self.stage
        meta, got = st.recv_streams("the call's streams")
        out, taps_out, scores = [], [], []
        if meta.get("failed") or meta["error"]:
            pass
        else:
            try:
                out, taps_out, scores = self._run(cmd, got[0], meta)
                if st.last and cmd["rows"] != "all":
                    out = [] if cmd["rows"] == "none" else [out[0][-1:]]
            except Exception as e:                    # goes down the pipeline to rank 0
                meta = {"error": f"{st.describe()} failed: {type(e).__name__}: {e}"}
        meta = {**meta, "taps": meta.get("taps", []) + taps_out, "scores": meta.get("scores", []) + scores}
        st.send_streams(meta, out, "the call's streams", peer=(st.rank + 1) % st.world)

    def _run(self, cmd, H, meta):
        """This rank's layers of one call; `meta["carried"]` comes in and goes on updated."""
        key = cmd["key"]
        if key in self.broken:
            raise RuntimeError(f"its model could not be built: {self.broken[key]}")
        from reference_model import Taps
        model, sink = self.models[key], self.scores[key]
        state = self.states.get(cmd["state"])
        if state is None:
            state = self.states[cmd["state"]] = stage_state(model, self.stage)
        taps = Taps(cmd["taps"], latest=cmd["latest"]) if cmd["taps"] else None
        tokens = cmd["tokens"].to(H.device)
        del sink[:]
        carry_in(state, meta["carried"])
        with co_batched(cmd["mates"]):
            for i in self.stage.layers:
                H = model.layer(i, H, tokens, state, taps, cmd["phase"])
        state.pos += tokens.numel()
        meta["carried"] = carried(state)
        parts = [(n, p) for n in (taps.names() if taps else []) for p in taps.parts(n)]
        return [H], parts, list(sink)


    def state_op(self, cmd) -> None:
        """Rank 0's state_op on this rank's part; the reply (bytes, or an error) is gathered."""
        try:
            model = self.models[cmd["key"]]
            state = self.states.get(cmd["state"])
            if state is None:                  # created on rank 0, never extended yet
                state = self.states[cmd["state"]] = stage_state(model, self.stage)
            out = _state_op(model, self.stage.layers, cmd["what"], state)
            if cmd["new"] is not None:
                self.states[cmd["new"]] = out
            if cmd["what"] != "bytes":
                out = None
        except Exception as e:
            out = f"{self.stage.describe()} failed ({cmd['what']} of a state): {type(e).__name__}: {e}"
        self.stage.gather(out, f"the {cmd['what']} of a state")


def _state_op(model, layers: range, op: str, state):
    """One rank's part of PipelineModel.state_op, on its own layers only."""
    import copy
    if op == "copy":
        return copy.deepcopy(state)
    if op == "bytes":
        from fidelity.serve.prefix_cache import state_bytes
        return sum(state_bytes(state.layers[i]) for i in layers)
    if op == "restore":
        out = copy.copy(state)
        out.layers = [model.nx.state_restore(st) if i in layers else copy.deepcopy(st)
                      for i, st in enumerate(state.layers)]
        return out
    if op == "boundary":
        state.layers = [model.nx.chunk_boundary(st) if i in layers else st for i, st in enumerate(state.layers)]
        return state
    raise ValueError(f"unknown state op {op!r}")


def _batch_mates() -> int:
    """Tokens the other sequences of this step bring (schedule.co_batched), as batch_tokens
    reads them in a step of none of our own; sent with each call so a worker's
    batch-dependent kernels see what rank 0's see."""
    with in_step(0):
        return batch_tokens()


def work(stage, weights) -> None:
    """A rank > 0: run rank 0's calls on this stage's layers until it says stop."""
    w, group = _Worker(stage, weights), calls_group()
    while True:
        cmd = stage.from_first(None, "rank 0's next call", group)
        for sid in cmd["free"]:
            w.states.pop(sid, None)
        if cmd["op"] == "stop":
            return
        if cmd["op"] == "model":
            w.build(cmd["key"], cmd["recipe"])
        elif cmd["op"] == "extend":
            w.extend(cmd)
        elif cmd["op"] == "state":
            w.state_op(cmd)


# ---- the commands' side ---------------------------------------------------------------------
@dataclass(frozen=True)
class Need:
    """What a per-prompt command holds at once, for the stage memory check: `sequences`
    states of `length` tokens (one prompt or trial per in-process arm, or serve's requests),
    `logits` 'all' or 'last', and `cached_state` bytes of prefix-cache snapshots."""
    length: int
    sequences: int
    logits: str = "all"
    cached_state: int = 0


def run_ranks(args, on_rank0, need=None) -> int:
    """Every rank of a per-prompt command under torchrun: rank 0 runs `on_rank0(driver)`
    (the command itself, its in-process arms as pipeline models); the others run its calls
    on their layers until it stops them. `need(cfg)` -> Need: every rank checks every stage
    against its budget first (the head on rank 0), so one that does not fit stops them all."""
    from .pipeline import shutdown
    stage = join(args)
    try:
        if need is not None:
            from fidelity.weights.source import checkpoint_config
            cfg = checkpoint_config(args.checkpoint)
            n = need(cfg)
            stage.check_memory(cfg, min(n.length, cfg.max_seq_len), 1, n.sequences,
                               stage_weights_mode(args.weights_mode), logits=n.logits, head_first=True,
                               cached_state=n.cached_state)
        if not stage.first:
            work(stage, stage_weights(args.checkpoint, args.weights_mode, stage))
            return 0
        driver = Driver(stage)
        try:
            return on_rank0(driver)
        finally:
            driver.stop()
    finally:
        shutdown()


def join(args):
    """This rank's Stage for a per-prompt command (`args.checkpoint`'s config)."""
    from fidelity.weights.source import checkpoint_config
    from .pipeline import init_stage
    from fidelity.weights.sizes import parse_bytes
    cfg = checkpoint_config(args.checkpoint)
    try:
        budget = parse_bytes(args.device_memory) if args.device_memory else None
    except ValueError as e:
        raise DistributedError(f"--device-memory: {e}") from None
    return init_stage(cfg, args.dist_timeout, args.distributed or None, budget)


def stage_weights_mode(mode: str | None) -> str:
    """Streamed (each rank reads its layers as it runs them) unless resident-quantised
    (each rank reads only its layers); dense would hold every layer on every rank."""
    if mode == "dense":
        raise DistributedError("--weights-mode dense loads every layer on every rank; with --distributed use "
                               "streamed (the default) or resident-quantised")
    return mode or "streamed"


def stage_weights(checkpoint, mode: str | None, stage):
    """This stage's weight source: only its layers are ever read (globals on every rank)."""
    from fidelity.weights.source import load_weights
    devices = [str(stage.device)] if stage.device.type == "cuda" else None
    return load_weights(checkpoint, mode=stage_weights_mode(mode), devices=devices, layers=stage.layers)[0]


def command_target(args, place, driver=None):
    """A per-prompt command's Target: the whole model in this process (dense unless
    --weights-mode), or on rank 0 of a pipeline its stage's weights, which `driver` runs."""
    if driver is None:
        from fidelity.weights.target import load_target
        return load_target(args.checkpoint, args.tokenizer, args.weights_mode or "dense", place.model_devices)
    target = stage_target(args.checkpoint, args.tokenizer, args.weights_mode, driver.stage)
    driver.weights = target.weights
    return target


def stage_target(checkpoint, tokenizer, mode: str | None, stage):
    """Rank 0's Target (tokenizer, name) over this stage's weights."""
    import dataclasses
    from fidelity.weights.target import load_target
    target = load_target(checkpoint, tokenizer, "streamed")          # lazy: reads no layer
    return dataclasses.replace(target, weights=stage_weights(checkpoint, mode, stage))
