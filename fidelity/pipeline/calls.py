"""What rank 0 and the workers of a per-prompt pipeline (fidelity.pipeline.model) share:
the group rank 0's calls are broadcast in, the picklable recipe every rank builds an arm's
model from, a rank's model devices, one rank's part of a state operation, the batch mates
each call carries, and StageError for a call that failed on another rank."""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from reference_model import build_model
from reference_model.schedule import ONESHOT, batch_tokens, in_step


class StageError(RuntimeError):
    """A call failed on another rank: the message names it (the command's error)."""


@dataclass
class Recipe:
    """How every rank builds one arm's Model (picklable: it travels with rank 0's call)."""
    numerics: tuple                      # (module-level function, *args) -> Numerics
    schedule: object = ONESHOT
    chunk_tokens: int = 2048
    record_index_scores: bool = False    # return each index_scores result (needle's mechanism)

    def build(self, weights, devices, cache: dict, record=None):
        """The Model; with record_index_scores, `record(scores)` gets each index_scores result."""
        fn, *args = self.numerics
        nx = fn(*args)
        if self.record_index_scores:
            nx = nx.recording_index_scores(record)
        return build_model(weights, nx, chunk_tokens=self.chunk_tokens, devices=devices,
                           schedule=self.schedule, weight_cache=cache)


CALL_WAIT = datetime.timedelta(days=30)      # a worker waits for rank 0's next call this long


def calls_group():
    """The group rank 0's calls are broadcast in (every rank joins it, in the same order):
    gloo, with no practical timeout, since rank 0 may be busy elsewhere (an endpoint arm)
    or idle between calls. A dead rank 0 still ends the wait: its connections close."""
    return dist.new_group(backend="gloo", timeout=CALL_WAIT)


def stage_devices(stage) -> list | None:
    """A rank's model devices: its GPU, or None (CPU as given)."""
    return [stage.device] if stage.device.type == "cuda" else None


def rank_state_op(model, layers: range, op: str, state):
    """One rank's part of PipelineModel.state_op, on its own layers only."""
    import copy
    if op == "copy":
        return copy.deepcopy(state)
    if op == "bytes":
        from reference_model.state import state_bytes
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


def batch_mates() -> int:
    """Tokens the other sequences of this step bring (schedule.co_batched), as batch_tokens
    reads them in a step of none of our own; sent with each call so a worker's
    batch-dependent kernels see what rank 0's see."""
    with in_step(0):
        return batch_tokens()
