"""The golden across processes and nodes: pipeline stages over torch.distributed.

Launched by `torchrun` (gloo on CPU, NCCL on GPUs): every rank runs the same command, and
the layer-major lockstep (fidelity.ab.lockstep) runs on each rank only the contiguous
layers its stage owns (placement balanced on weight bytes, reference_model.placement, as
one process places them over devices; on DeepSeek-V4.1 cut only where no later layer
reads an earlier stage's state, `segments`). Rank 0 embeds; each stage's residual streams go to
the next stage with send/recv (exact bytes, any dtype); the last stage runs the head and
sends every rank the next greedy token and which arms are still alive. Per-prompt state
never leaves its stage. The rows each stage measured are all-gathered at the end of a
run, so every rank holds the same tables and takes the same decisions (the factorial
stage, the verdict); rank 0 alone prints and writes reports.

A peer that dies or cannot be reached surfaces as one DistributedError naming the rank,
its layers and what was being exchanged; the process-group timeout bounds every wait, so
no rank hangs."""
from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fidelity.errors import CommandError
from fidelity.weights.stages import StageCutError, segments, stage_ranges  # noqa: F401 (the stages' API)

DEFAULT_TIMEOUT_S = 600


class DistributedError(CommandError, RuntimeError):
    """The process group could not be formed or a peer failed: names the rank and stage."""


@dataclass(frozen=True)
class Stage:
    """This rank's part of the pipeline: `layers` (contiguous), on `device`."""
    rank: int
    world: int
    layers: range
    ranges: tuple               # every rank's layers, for messages
    device: torch.device
    budgets: tuple = ()         # every rank's memory budget in bytes (None: unknown, no check)

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1

    def describe(self, rank: int | None = None) -> str:
        k = self.rank if rank is None else rank
        r = self.ranges[k]
        return f"rank {k} (layers {r.start}-{r.stop - 1})" if len(r) else f"rank {k} (no layers)"

    def check_memory(self, cfg, spec) -> None:
        """Every stage against its budget, from the config alone (fidelity plan-memory's
        plan of this pipeline); the same DistributedError on every rank when one does not
        fit, naming it with the plan's numbers, before anything is computed. `spec`: the
        pass, a fidelity.weights.plan.PassSpec (its devices, budgets and pipeline are this
        pipeline's; the per-prompt commands run the head on rank 0, serve keeps prefix-cache
        snapshots in `cached_state`)."""
        if not self.budgets or None in self.budgets:
            return
        from dataclasses import replace

        from fidelity.weights.plan import GiB, PlanDevices, plan_memory
        labels = [str(self.device) if self.device.type == "cpu" else f"cuda:{k}" for k in range(self.world)]
        plan = plan_memory(cfg, PlanDevices(labels, list(self.budgets)), replace(spec, pipeline=True),
                           advise=False)
        for k, d in enumerate(plan.devices):
            if d.total > d.budget:
                g = lambda b: f"{b / GiB:.2f} GiB"        # noqa: E731
                cached = f", besides {g(spec.cached_state)} of held state over all ranks" if spec.cached_state else ""
                raise DistributedError(
                    f"{self.describe(k)} does not fit: it needs {g(d.total)} of {g(d.budget)} (weights "
                    f"{g(d.weights)}, dequant {g(d.dequant)}, state {g(d.state)}, streams {g(d.streams)}, "
                    f"logits {g(d.logits)}, workspace {g(d.workspace)}) for {spec.prompts} prompt(s) x "
                    f"{spec.arms} arm(s) of {spec.length} tokens{cached}; `fidelity plan-memory --nodes` "
                    "says what would fit")

    # ---- exchanges ------------------------------------------------------------------
    def send_streams(self, meta: dict, tensors: list[torch.Tensor], what: str, peer: int | None = None) -> None:
        """To the next stage (or `peer`): `meta` (any picklable object) then each tensor's bytes."""
        peer = self.rank + 1 if peer is None else peer
        with self._peer(peer, f"sending {what}"):
            dist.send_object_list([meta, [(tuple(t.shape), str(t.dtype)) for t in tensors]], dst=peer)
            for t in tensors:
                dist.send(_bytes(t), dst=peer)

    def recv_streams(self, what: str, peer: int | None = None) -> tuple[dict, list[torch.Tensor]]:
        """From the previous stage (or `peer`): what its send_streams sent."""
        peer = self.rank - 1 if peer is None else peer
        with self._peer(peer, f"waiting for {what}"):
            box = [None, None]
            dist.recv_object_list(box, src=peer, device=self._obj_device())
            meta, shapes = box
            out = []
            for shape, dtype in shapes:
                dt = getattr(torch, dtype.replace("torch.", ""))
                buf = torch.empty(_nbytes(shape, dt), dtype=torch.uint8, device=self.device)
                dist.recv(buf, src=peer)
                out.append(buf.view(dt).reshape(shape))
        return meta, out

    def from_last(self, obj, what: str):
        """`obj` of the last stage, on every rank."""
        box = [obj]
        with self._peer(self.world - 1, f"waiting for {what}"):
            dist.broadcast_object_list(box, src=self.world - 1, device=self._obj_device())
        return box[0]

    def from_first(self, obj, what: str, group=None):
        """`obj` of rank 0, on every rank (rank 0's calls to the other stages); `group`: a
        gloo group of every rank (then on the CPU), e.g. one without the default timeout."""
        box = [obj]
        with self._peer(None, f"sending {what}") if self.first else self._peer(0, f"waiting for {what}"):
            dist.broadcast_object_list(box, src=0, group=group, device=None if group else self._obj_device())
        return box[0]

    def gather(self, obj, what: str) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        out = [None] * self.world
        with self._peer(None, f"gathering {what}"):
            dist.all_gather_object(out, obj)
        return out

    def _obj_device(self):
        return self.device if self.device.type == "cuda" else None

    def _peer(self, peer: int | None, doing: str):
        return _Guard(self, peer, doing)


class _Guard:
    """Turns a failed collective into one DistributedError that names the peer."""

    def __init__(self, stage: Stage, peer: int | None, doing: str):
        self.stage, self.peer, self.doing = stage, peer, doing

    def __enter__(self):
        return self

    def __exit__(self, typ, e, tb):
        if e is None or isinstance(e, DistributedError) or not isinstance(e, (RuntimeError, OSError)):
            return False
        who = self.stage.describe(self.peer) if self.peer is not None else "a peer"
        raise DistributedError(f"{self.stage.describe()} lost contact with {who} while {self.doing}: "
                               f"{_first_sentence(e)} (a rank died or the network failed; see that "
                               "rank's log)") from None


def _first_sentence(e: Exception) -> str:
    """gloo's / NCCL's message without its source location and advice."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", (str(e).splitlines() or [""])[0])
    return text.split(". ")[0] or type(e).__name__


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def launched() -> bool:
    """Started by torchrun (or by hand with the same environment)?"""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


class StageStateError(AttributeError):
    """A layer read the state of a layer on another stage (a toggle that reads across the
    cuts, e.g. v41_stale_index_keys' shared key slot): an error, never an empty read."""


class _Elsewhere:
    """Stands in for a layer's state that lives on another stage; any read of it fails."""
    __slots__ = ("where",)

    def __init__(self, where: str):
        object.__setattr__(self, "where", where)

    def __getattr__(self, name):
        raise StageStateError(f"{self.where}'s state is on another pipeline stage, and this arm reads it "
                              f"({name}); run it in one process")

    def __setattr__(self, name, value):
        self.__getattr__(name)

    def __deepcopy__(self, memo):
        return self


CARRIED = ("key_writer",)     # V4.1: the KV source that emitted index keys last (doc §9 D1)


def carried(state) -> dict:
    """The sequence-level fields a layer writes and a later one reads (V4.1's key_writer),
    which travel with the residual streams so every stage sees the value one process has."""
    return {k: getattr(state, k) for k in CARRIED if hasattr(state, k)}


def carry_in(state, fields: dict) -> None:
    for k, v in fields.items():
        setattr(state, k, v)


def stage_state(model, stage):
    """A new sequence state of `model` for this stage (None: one process): on DeepSeek-V4.1
    the layers of the other stages hold a stand-in that fails when read, so a read across
    the cuts is an error naming the layer rather than a silently empty cache."""
    state = model.new_state()
    from reference_model.v41 import is_v41
    if stage is not None and is_v41(model.cfg):
        for j in range(model.cfg.n_layers):
            if j not in stage.layers:
                state.layers[j] = _Elsewhere(f"layer {j}")
    return state


def weights_mode(weights) -> str:
    """The plan-memory weights mode of a loaded weight source."""
    from reference_model.checkpoint import StreamingWeights
    from reference_model.resident import QuantisedResidentWeights
    if isinstance(weights, QuantisedResidentWeights):
        return "resident-quantised"
    return "streamed" if isinstance(weights, StreamingWeights) else "resident-bf16"


def init_stage(cfg, timeout_s: float = DEFAULT_TIMEOUT_S, expect_world: int | None = None,
               budget: int | None = None) -> Stage:
    """Join the process group torchrun describes (env://) and return this rank's stage.
    Errors (DistributedError): not launched by torchrun, a world size other than the one
    asked for or larger than the layer count, rank 0's store unreachable within the timeout.
    `budget`: this rank's memory in bytes (default: its GPU's total memory; none on CPU)."""
    if not launched():
        raise DistributedError("--distributed needs the environment torchrun sets (WORLD_SIZE, RANK, "
                               "MASTER_ADDR, MASTER_PORT): launch with e.g. `torchrun --nproc-per-node 2 "
                               "-m fidelity ab --distributed ...`")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if expect_world is not None and expect_world != world:
        raise DistributedError(f"--distributed {expect_world} ranks asked for, but torchrun started "
                               f"{world} (WORLD_SIZE={world}); give the same number to both")
    if world < 2:
        raise DistributedError(f"--distributed needs at least 2 ranks, torchrun started {world}")
    try:
        ranges = tuple(stage_ranges(cfg, world))
    except StageCutError as e:
        raise DistributedError(str(e)) from None
    cuda = torch.cuda.is_available() and os.environ.get("FIDELITY_DIST_BACKEND", "") != "gloo"
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device(f"cuda:{local}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    addr = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if not dist.is_initialized():
        try:
            dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, OSError, ValueError) as e:
            raise DistributedError(f"rank {rank}: could not join the process group at {addr} within "
                                   f"{timeout_s:g} s ({_first_sentence(e)}); is "
                                   "rank 0's node reachable and MASTER_ADDR/MASTER_PORT right?") from None
    if budget is None and cuda:
        budget = int(torch.cuda.get_device_properties(device).total_memory)
    stage = Stage(rank, world, ranges[rank], ranges, device)
    return Stage(rank, world, ranges[rank], ranges, device, tuple(stage.gather(budget, "memory budgets")))


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
