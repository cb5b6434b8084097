"""One pass placed on its devices: the layers split over them (balanced on weight bytes,
or the pipeline's stages), the globals on the first and last, and each device's bytes by
term (weights, dequant, state, streams, logits, workspace; the terms are described in
fidelity/weights/plan.py). `plan_pass` is the whole plan of a PassSpec; advice re-plans
variants of it."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from fidelity.weights.stages import segments, stage_ranges
from reference_model.config import ModelConfig
from reference_model.placement import place_layers

from .plan_layers import (StateDtypes, dequant_bytes, layer_table, sequence_state_bytes,
                          spec_bytes, state_dtypes, version_global_specs)

FIRST_GLOBALS = ("embed.weight",)               # the rest of the globals go with the head
METRIC_COPIES = 6             # fp64 [rows, vocab] copies alive while a chunk is reduced (5.2 measured)
# the A/B head's chunk as the plan sizes it (fidelity.ab.head reduces METRIC_ROWS rows at once and
# keeps POSITION_STAT_BYTES per position and arm; tests/test_plan_memory.py holds the two together)
METRIC_ROWS = 64
POSITION_STAT_BYTES = 82       # 8 float64, 2 int64 and 2 bool per position, as ab.head's row_stats keeps them



@dataclass
class DevicePlan:
    device: str
    budget: int
    layers: list[int]
    globals: list[str]
    weights: int = 0
    dequant: int = 0
    state: int = 0
    streams: int = 0
    logits: int = 0
    workspace: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.dequant + self.state + self.streams + self.logits + self.workspace

    @property
    def free(self) -> int:
        return self.budget - self.total

    @property
    def fits(self) -> bool:
        return self.total <= self.budget


@dataclass
class MemoryPlan:
    model: str
    n_layers: int
    max_seq_len: int
    length: int
    prompts: int
    arms: int
    weights_mode: str
    dequant: str
    profile: str
    logits_mode: str
    dtypes: StateDtypes
    devices: list[DevicePlan]
    per_sequence: dict            # state (all layers), stream, logits: bytes for one sequence
    totals: dict                  # model-wide sums of each term
    advice: list[str] = field(default_factory=list)

    @property
    def sequences(self) -> int:
        return self.prompts * self.arms

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    @property
    def tightest(self) -> DevicePlan:
        return min(self.devices, key=lambda d: d.free)

    def to_dict(self) -> dict:
        d = asdict(self)
        for dp, src in zip(d["devices"], self.devices):
            dp.update(total=src.total, free=src.free, fits=src.fits)
        d.update(fits=self.fits, sequences=self.sequences)
        return d


@dataclass(frozen=True)
class PassSpec:
    """One pass to plan: `prompts` x `arms` sequences of `length` tokens on `devices`, each
    with its memory budget in bytes (plan_memory fills both in from its PlanDevices).
    plan_advice varies these fields to find what would fit."""
    length: int
    prompts: int = 1
    arms: int = 1
    weights_mode: str = "resident-quantised"
    dequant: str = "full"
    logits_mode: str = "all"
    head_first: bool = False      # the head (and its logits) on the first device, not the last
    cached_state: int = 0         # state snapshots kept besides the pass (serve's prefix cache)
    pipeline: bool | None = None  # one rank per device: the stages fidelity.weights.stages cuts (None: nodes > 1)
    devices: tuple[str, ...] = ()
    budgets: tuple[int, ...] = ()

    @property
    def sequences(self) -> int:
        return self.prompts * self.arms


@dataclass(frozen=True)
class PlanNumerics:
    """What the numerics and the kernels keep, fixed for one plan and its advice."""
    dtypes: StateDtypes
    profile: str                  # its name in the plan ("custom" for a Numerics)
    chunk_tokens: int = 2048
    attn_budget: int = 1 << 25

    @classmethod
    def of(cls, profile="reference", chunk_tokens: int = 2048, attn_budget: int = 1 << 25) -> PlanNumerics:
        """From a profile name (plan_inputs.PROFILES) or a StateDtypes ("custom")."""
        return cls(profile if isinstance(profile, StateDtypes) else state_dtypes(profile),
                   profile if isinstance(profile, str) else "custom", chunk_tokens, attn_budget)


def most_stages(cfg) -> int:
    """The most pipeline ranks the layers can be cut into (fidelity.weights.stages.segments)."""
    return len(segments(cfg))


@dataclass(frozen=True)
class PassSizes:
    """Byte counts of one pass that do not depend on the device."""
    table: list                   # layer_table(cfg)
    first_g: list                 # global tensors on the first device (embed)
    last_g: list                  # global tensors on the last device (head, norms)
    wkey: str                     # "quantised" or "bf16": the resident weights' format
    state_layer: list             # one sequence's state bytes per layer
    stream_seq: int               # one sequence's residual stream
    logit_rows: int               # logits rows held per arm at once (one head chunk)
    stat_rows: int                # positions whose logit statistics are kept per arm
    act: int                      # attention / q,o workspace of one chunk


def pass_sizes(cfg: ModelConfig, spec: PassSpec, nx: PlanNumerics) -> PassSizes:
    dt = nx.dtypes
    chunk = min(spec.length, nx.chunk_tokens)
    gspecs = version_global_specs(cfg)
    return PassSizes(
        table=layer_table(cfg),
        first_g=[s for s in gspecs if s.name in FIRST_GLOBALS],
        last_g=[s for s in gspecs if s.name not in FIRST_GLOBALS],
        wkey="quantised" if spec.weights_mode == "resident-quantised" else "bf16",
        state_layer=[sequence_state_bytes(cfg, i, spec.length, dt) for i in range(cfg.n_layers)],
        stream_seq=spec.length * cfg.hc_mult * cfg.dim * dt.stream,
        logit_rows=min(spec.length, nx.chunk_tokens) if spec.logits_mode == "all" else 1,
        stat_rows=spec.length if spec.logits_mode == "all" else 1,
        act=4 * chunk * cfg.n_heads * cfg.head_dim * dt.compute + nx.attn_budget * dt.compute)


def plan_pass(cfg: ModelConfig, spec: PassSpec, nx: PlanNumerics) -> MemoryPlan:
    sz = pass_sizes(cfg, spec, nx)
    gspecs = version_global_specs(cfg)
    if spec.pipeline:
        ranges = stage_ranges(cfg, len(spec.devices))
    else:
        ranges = place_layers([r[sz.wkey] for r in sz.table], len(spec.devices),
                              sum(spec_bytes(s, sz.wkey) for s in sz.first_g),
                              sum(spec_bytes(s, sz.wkey) for s in sz.last_g))
    plans = [_device_plan(cfg, spec, nx, sz, k, list(rng)) for k, rng in enumerate(ranges)]
    table, seqs = sz.table, spec.sequences
    totals = {
        "weights_quantised": sum(spec_bytes(s, "quantised") for s in gspecs)
        + sum(r["quantised"] for r in table),
        "weights_bf16": sum(spec_bytes(s, "bf16") for s in gspecs) + sum(r["bf16"] for r in table),
        "largest_layer_bf16": max(r["bf16"] for r in table),
        "host_mapped": sum(r.get("host_mapped", 0) for r in table),
        "state": seqs * sum(sz.state_layer),
    }
    per_seq = {"state": sum(sz.state_layer), "stream": sz.stream_seq,
               "logits": sz.logit_rows * cfg.vocab_size * 4 + sz.stat_rows * POSITION_STAT_BYTES,
               "state_by_kind": _state_by_kind(cfg, sz.state_layer)}
    return MemoryPlan(cfg.name, cfg.n_layers, cfg.max_seq_len, spec.length, spec.prompts,
                      spec.arms, spec.weights_mode, spec.dequant, nx.profile, spec.logits_mode,
                      nx.dtypes, plans, per_seq, totals)


def _device_plan(cfg: ModelConfig, spec: PassSpec, nx: PlanNumerics, sz: PassSizes,
                 k: int, layers: list[int]) -> DevicePlan:
    """Device k of the pass, holding `layers` (and embed if first, the head if last)."""
    table, dt = sz.table, nx.dtypes
    last = 0 if spec.head_first else len(spec.devices) - 1          # the device running the head
    gl = (sz.first_g if k == 0 else []) + (sz.last_g if k == last else [])
    p = DevicePlan(spec.devices[k], spec.budgets[k], layers, [s.name for s in gl])
    g_bytes = sum(spec_bytes(s, sz.wkey) for s in gl)
    if spec.weights_mode == "streamed":
        p.weights = g_bytes + max((table[i]["bf16"] for i in layers), default=0)
    else:
        p.weights = g_bytes + sum(table[i][sz.wkey] for i in layers)
    if spec.weights_mode == "resident-quantised":
        pass_tokens = spec.prompts * spec.length          # tokens one layer pass routes
        p.dequant = max((dequant_bytes(table[i]["dequant"], cfg, spec.dequant, pass_tokens)
                         for i in layers), default=0)
    p.state = spec.sequences * sum(sz.state_layer[i] for i in layers)
    if spec.cached_state:
        p.state += spec.cached_state * sum(sz.state_layer[i] for i in layers) // max(1, sum(sz.state_layer))
    p.streams = (spec.sequences + 2) * sz.stream_seq if (layers or gl) else 0
    largest = max([table[i]["largest"] for i in layers]
                  + [s.numel for s in gl if s.name != "embed.weight"], default=0)
    p.workspace = (largest * dt.compute + sz.act) if layers else largest * dt.compute
    if k == last:
        p.logits = spec.arms * (sz.logit_rows * cfg.vocab_size * 4 + sz.stat_rows * POSITION_STAT_BYTES)
        if dt.compute != 4:
            p.workspace += sz.logit_rows * cfg.vocab_size * dt.compute
        p.workspace += METRIC_COPIES * min(METRIC_ROWS, sz.logit_rows) * cfg.vocab_size * 8
    return p


def _state_by_kind(cfg, state_layer) -> dict:
    out: dict[str, list[int]] = {}
    for i, b in enumerate(state_layer):
        c = out.setdefault(cfg.layer_kind(i), [0, 0])
        c[0] += 1
        c[1] += b
    return {k: {"layers": n, "bytes": b} for k, (n, b) in out.items()}
