"""The golden's Model API across pipeline ranks, for commands that call the model one
prompt or request at a time (`fidelity kld`, `needle`, `serve`): a driver/worker split
over the stages of fidelity.pipeline.stage.

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
arguments returning the Numerics), since a Numerics with replaced kernels does not pickle.

The parts: calls (what every rank shares), driver (rank 0: Driver,
PipelineModel, PipelineState), worker (ranks > 0: `work`). This module is the
commands' side: run a command on every rank, its Target and weights, an arm's recipe."""
from __future__ import annotations

from dataclasses import dataclass

from .stage import DistributedError
from .calls import StageError
from .driver import Driver, PipelineModel, PipelineState
from .worker import work

__all__ = ["Driver", "Need", "PipelineModel", "PipelineState", "StageError", "arm_numerics",
           "command_target", "join", "run_ranks", "stage_target", "stage_weights",
           "stage_weights_mode", "work"]


def arm_numerics(spec: str, profile: str = "reference", numerics_kwargs: dict | None = None,
                 model: str = "v4"):
    """An arm's Numerics from its spelling (fidelity.design.arms; `engine` as for a `model`
    checkpoint): a recipe every rank can rebuild."""
    from fidelity.design.arms import parse_arm
    return parse_arm(spec, model).numerics(profile, **(numerics_kwargs or {}))


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
    from .stage import shutdown
    stage = join(args)
    try:
        if need is not None:
            from fidelity.weights.source import checkpoint_config
            cfg = checkpoint_config(args.checkpoint)
            n = need(cfg)
            from fidelity.weights.plan import PassSpec
            stage.check_memory(cfg, PassSpec(min(n.length, cfg.max_seq_len), 1, n.sequences,
                                             stage_weights_mode(args.weights_mode), logits_mode=n.logits,
                                             head_first=True, cached_state=n.cached_state))
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
    from .stage import init_stage
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
