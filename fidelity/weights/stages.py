"""Where a pipeline of ranks cuts the layers (fidelity.pipeline, fidelity plan-memory
--nodes): contiguous stages balanced on weight bytes, as one process places layers over
its devices (reference_model.placement), cut only where no later layer reads an earlier
stage's state (DeepSeek-V4.1's KV, index and candidate sources)."""
from __future__ import annotations

from fidelity.errors import CommandError
from reference_model.placement import end_bytes, layer_bytes, place_layers


class StageCutError(CommandError, ValueError):
    """The layers cannot be cut into that many stages: names the most there can be."""


def stage_ranges(cfg, world: int) -> list[range]:
    """Each rank's layers: contiguous, balanced on weight bytes with the embedding on the
    first rank and the head on the last (the same rule as one process over devices), cut
    only between `segments` (no layer reads another stage's state). StageCutError when
    the layers cannot be cut into `world` stages."""
    segs = segments(cfg)
    if world > len(segs):
        raise StageCutError(too_many_ranks(cfg, world, len(segs)))
    layer_b, first, last = _weight_bytes(cfg)
    groups = place_layers([sum(layer_b[i] for i in s) for s in segs], world, first, last, nonempty=True)
    return [range(segs[g.start].start, segs[g.stop - 1].stop) for g in groups]


def reads(cfg, i: int) -> set[int]:
    """The other layers whose state layer i reads: DeepSeek-V4.1's KV source (compressed KV,
    index keys), index source (top-k) and candidate source (blocks); none on V4."""
    from reference_model.v41 import is_v41
    if not is_v41(cfg):
        return set()
    out = {cfg.kv_source(i), cfg.index_source(i)}
    if cfg.uses_candidates(i):
        out.add(cfg.candidate_source_layer)
    return {j for j in out if j is not None and j != i}


def segments(cfg) -> list[range]:
    """The layers in runs a stage boundary may not split: a cut before layer c is allowed
    when no layer from c on reads a layer before c (every layer on V4), so no layer's state
    ever crosses the network, only the residual streams."""
    n, lo, cuts = cfg.n_layers, cfg.n_layers, []
    for c in range(n - 1, 0, -1):
        lo = min(lo, c, *reads(cfg, c))
        if lo >= c:
            cuts.append(c)
    edges = [0, *cuts[::-1], n]
    return [range(a, b) for a, b in zip(edges, edges[1:])]


def too_many_ranks(cfg, world: int, most: int) -> str:
    """Why `world` stages cannot be cut, and the most there can be."""
    if most == cfg.n_layers:
        return (f"{world} ranks for {cfg.n_layers} layers: every stage needs at least one layer; use at most "
                f"{most} ranks")
    cuts = ", ".join(str(s.start) for s in segments(cfg)[1:]) or "none"
    return (f"{world} ranks for {cfg.n_layers} layers: each DeepSeek-V4.1 layer must sit on the stage of the KV, "
            f"index and candidate sources it reads, so the layers can be cut only before layers {cuts}: "
            f"at most {most} stages; use at most {most} ranks")


def _weight_bytes(cfg) -> tuple[list[int], int, int]:
    """(each layer's weights in memory, the embedding, the other globals), of the config's
    version (as reference_model.placement and v41_placement count them)."""
    from reference_model.v41 import is_v41
    if not is_v41(cfg):
        return (layer_bytes(cfg), *end_bytes(cfg))
    from reference_model.v41.sizes import layer_row, spec_bytes
    from reference_model.v41.specs import global_specs
    first = sum(spec_bytes(s, "bf16") for s in global_specs(cfg) if s.name.startswith("embed"))
    return ([layer_row(cfg, i)["bf16"] for i in range(cfg.n_layers)], first,
            sum(spec_bytes(s, "bf16") for s in global_specs(cfg)) - first)
