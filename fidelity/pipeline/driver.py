"""Rank 0's side of a per-prompt pipeline (fidelity.pipeline.model): the Driver that
sends every call down the ranks, and the PipelineModel / PipelineState handles the command
uses in place of a Model and its SequenceState."""
from __future__ import annotations

import itertools
import sys
import threading
import weakref
from dataclasses import dataclass, field

import torch

from reference_model.schedule import ONESHOT

from .stage import DistributedError, carried, carry_in, stage_state
from .calls import (Recipe, StageError, batch_mates, calls_group, rank_state_op,
                             stage_devices)


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
        recipe = Recipe(numerics, schedule, chunk_tokens, record is not None)
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

    def __init__(self, driver: Driver, key: int, recipe: Recipe, record=None):
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
                mine = rank_state_op(self.local, self.driver.stage.layers, op, state.local)
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
                 "rows": rows, "mates": batch_mates()})
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
