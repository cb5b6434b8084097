"""Memory plan for a lockstep run of the golden model on a set of devices, from the config
alone (shape arithmetic over the tensor table; nothing is loaded or allocated).

`plan_memory(cfg, devices, length, prompts, arms, weights_mode, device_memory)` places the
layers contiguously over the devices (pipeline placement, weight bytes balanced; embed on
the first device, the head on the last) and returns a `MemoryPlan`: bytes per device for

  weights    resident weights: `resident-quantised` = checkpoint-format bytes (FP8 e4m3 +
             E8M0 128x128 scales, FP4 e2m1 two per byte + E8M0 per 32, bf16, f32, i64);
             `resident-bf16` = the in-memory format of reference_model/weights.py (FP8/FP4
             dequantised to bf16, f32 and i64 as stored); `streamed` = the globals placed on
             the device + its largest layer in the in-memory format (StreamingWeights keeps
             one layer resident). V4.1's Engram tables are not device weights: they stay
             memory-mapped on the host (checkpoint files; only gathered rows move), counted
             apart as `totals["host_mapped"]` and named in a line of the rendered plan.
  dequant    dequantisation buffer (resident-quantised only): the FP8/FP4 tensors of the
             device's largest layer dequantised to bf16 (bf16/f32/i64 tensors are used in
             place). With `dequant="expert-sparse"`, MoE layers dequantise the non-expert
             FP8 tensors + the shared expert + only the routed experts one pass can reach:
             min(n_routed_experts, tokens in the pass x n_activated_experts).
  state      per-sequence state of the device's layers (`sequence_state_bytes`) x prompts x
             arms: window KV rows, compressed KV entries, compressor partial windows, indexer
             keys, each in the dtype the numerics profile keeps it in.
  streams    the residual stream [length, hc_mult, dim] in the storage dtype, held for every
             (prompt, arm) of the pass, + 2 in flight (a layer's output chunks and their
             concatenation, for the one arm being computed).
  logits     last device: one head chunk [min(length, chunk_tokens), vocab] fp32 x arms (the
             lockstep's head runs a chunk of positions at a time and reduces it against
             golden's on the fly, fidelity.ab.head), + the per-position statistics kept for
             the tables [length] x arms; `logits="last"` keeps one row per arm.
  workspace  transient, one (prompt, arm) at a time (an estimate): the device's largest
             weight tensor converted to the compute dtype (the GEMM kernels convert weights
             per call), one attention gather (attn_budget elements) and one chunk's q / o
             [chunk, n_heads, head_dim] with their RoPE'd copies in the compute dtype, and on
             the last device one head chunk's logits in the compute dtype before the fp32
             cast and the fp64 copies of the metric rows reduced at once.

Prompts x arms sequences are planned as one pass (layer-major: every prompt and arm runs
layer i before any runs layer i+1, so every sequence's state and stream is held at once).
`length` is the tokens per sequence (prompt + decode steps). Placement `balanced` (default)
splits the layers so per-device weight bytes (with the globals) are as even as possible;
`even` is Model(devices=...)'s rule, layer i on device i·D // n_layers."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import torch

from fidelity.ab.head import METRIC_ROWS, POSITION_STAT_BYTES
from fidelity.devices import DeviceError, parse_devices
from fidelity.stages import segments, stage_ranges, too_many_ranks
from reference_model.checkpoint_format import disk_entries
from reference_model.config import ModelConfig
from reference_model.numerics import Numerics
from reference_model.placement import MEM_BYTES, place_layers
from reference_model.specs import FP4, FP8, TensorSpec, global_specs, layer_specs
from reference_model.v41 import is_v41
from reference_model.v41 import sizes as v41_sizes
from reference_model.v41.specs import global_specs as v41_global_specs

from .sizes import parse_bytes

WEIGHT_MODES = ("resident-quantised", "resident-bf16", "streamed")
DEQUANT_MODES = ("full", "expert-sparse")
PROFILES = ("reference", "reference-fp32", "exact")
LOGITS_MODES = ("all", "last")
FIRST_GLOBALS = ("embed.weight",)               # the rest of the globals go with the head
GiB = 1 << 30
METRIC_COPIES = 6             # fp64 [rows, vocab] copies alive while a chunk is reduced (5.2 measured)


class PlanError(ValueError):
    """Bad input to a memory plan (device string, length, counts, config, size)."""


# ---- input parsing --------------------------------------------------------------------------
def parse_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise PlanError(str(e)) from None


def device_budgets(devices: list[str], device_memory) -> list[int]:
    """Bytes available on each device: `device_memory` as one size for every device, a list
    (one per device), or None = read from torch.cuda (CUDA devices only)."""
    if device_memory is not None:
        vals = device_memory if isinstance(device_memory, (list, tuple)) else [device_memory]
        vals = [parse_size(v) if isinstance(v, str) else int(v) for v in vals]
        if len(vals) == 1:
            vals = vals * len(devices)
        if len(vals) != len(devices):
            raise PlanError(f"{len(vals)} device memory sizes for {len(devices)} devices")
        if any(v <= 0 for v in vals):
            raise PlanError("device memory must be positive")
        return vals
    if "cpu" in devices:
        raise PlanError("--device-memory is required for cpu devices (the host-memory budget)")
    try:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:                                  # noqa: BLE001 - no usable CUDA
        n = 0
    out = []
    for d in devices:
        i = int(d.split(":")[1])
        if i >= n:
            raise PlanError(f"{d} is not visible (torch.cuda.device_count() = {n}); "
                            "pass --device-memory to plan for it")
        out.append(int(torch.cuda.get_device_properties(i).total_memory))
    return out


# ---- dtypes ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class StateDtypes:
    """Bytes per element of what a numerics profile keeps between steps."""
    kv: int            # window KV rows and compressed KV entries
    compressor: int    # compressor partial window (kv and score rows)
    index_keys: int    # indexer keys
    stream: int        # residual stream between layers (storage dtype)
    compute: int       # compute dtype (GEMM weight copies, logits before the fp32 cast)


def state_dtypes(profile="reference") -> StateDtypes:
    """Probe the profile's kernels on one small row each (a Numerics or a profile name:
    'reference' = fp64 compute, 'reference-fp32' = fp32 compute, 'exact'), so toggles that
    change a stored dtype are followed without restating them here."""
    if isinstance(profile, Numerics):
        nx = profile
    elif profile == "reference-fp32":
        nx = Numerics("reference", torch.float32)
    elif profile in ("reference", "exact"):
        nx = Numerics(profile)
    else:
        raise PlanError(f"unknown profile {profile!r}; valid: {', '.join(PROFILES)}")
    x = torch.linspace(-1, 1, 128, dtype=nx.cd).view(1, 128)
    kv = torch.promote_types(nx.kv_store(x[:, :64]).dtype, nx.rs(x[:, 64:]).dtype)
    ckv, csc = nx.compress_state(x, x)
    comp = torch.promote_types(ckv.dtype, csc.dtype)
    ik = nx.index_key_store(x).dtype
    size = lambda dt: torch.empty((), dtype=dt).element_size()   # noqa: E731
    return StateDtypes(size(kv), size(comp), size(ik), size(nx.sd), size(nx.cd))


# ---- per-layer arithmetic -----------------------------------------------------------------
def spec_bytes(spec: TensorSpec, mode: str) -> int:
    """Bytes of one tensor: checkpoint format ('quantised', every safetensors entry incl.
    scales) or in-memory format ('bf16')."""
    if mode == "quantised":
        return sum(e.nbytes for e in disk_entries(spec))
    return spec.numel * MEM_BYTES[spec.fmt]


def _is_routed_expert(name: str) -> bool:
    return ".ffn.experts." in name


def layer_weight_bytes(cfg: ModelConfig, i: int, mode: str) -> int:
    if is_v41(cfg):
        return _layer_table(cfg)[i]["quantised" if mode == "quantised" else "bf16"]
    return sum(spec_bytes(s, mode) for s in layer_specs(cfg, i))


def _global_specs(cfg) -> list[TensorSpec]:
    """The globals of the config's version (V4.1: no hc_head; reference_model/v41)."""
    return v41_global_specs(cfg) if is_v41(cfg) else global_specs(cfg)


def dequant_buffer_bytes(cfg: ModelConfig, i: int, mode: str = "full", tokens: int = 0) -> int:
    """bf16 bytes of layer i's FP8/FP4 tensors dequantised for use; 'expert-sparse' counts
    the routed experts a pass of `tokens` tokens can reach (bounded by n_routed_experts)."""
    if is_v41(cfg):
        return _dequant(_layer_table(cfg)[i]["dequant"], cfg, mode, tokens)
    return _dequant(_dequant_parts(layer_specs(cfg, i), i), cfg, mode, tokens)


def _dequant_parts(specs, i: int) -> dict:
    q = [s for s in specs if s.fmt in (FP8, FP4)]
    return {"full": sum(s.numel * 2 for s in q),
            "base": sum(s.numel * 2 for s in q if not _is_routed_expert(s.name)),
            "expert": sum(s.numel * 2 for s in q if s.name.startswith(f"layers.{i}.ffn.experts.0."))}


def _dequant(parts: dict, cfg: ModelConfig, mode: str, tokens: int) -> int:
    if mode == "full":
        return parts["full"]
    reach = min(cfg.n_routed_experts, max(0, tokens) * cfg.n_activated_experts)
    return parts["base"] + reach * parts["expert"]


def sequence_state_elements(cfg: ModelConfig, i: int, length: int) -> dict[str, int]:
    """Elements of layer i's SequenceState after `length` tokens (reference_model/model.py
    LayerState), by part:
      window      min(length, window_size - 1) rows x head_dim (the last window-1 KV rows)
      comp_kv     length // ratio compressed entries x head_dim          (ratio > 0)
      comp        compressor partial window: (length % ratio) pending kv + score rows of
                  width coff·head_dim (coff 2 for ratio 4, else 1); ratio 4 also keeps the
                  last complete group (ratio rows of kv + score) once length >= 4
      index_keys  length // 4 indexer keys x index_head_dim                 (ratio 4)
      index_comp  the indexer's ratio-4 compressor, as `comp` with index_head_dim"""
    r = cfg.compress_ratios[i]
    out = {"window": min(length, cfg.window_size - 1) * cfg.head_dim,
           "comp_kv": 0, "comp": 0, "index_keys": 0, "index_comp": 0}

    def partial(ratio, d):
        width = (2 if ratio == 4 else 1) * d
        n = 2 * (length % ratio) * width
        if ratio == 4 and length >= ratio:
            n += 2 * ratio * width
        return n

    if r:
        out["comp_kv"] = (length // r) * cfg.head_dim
        out["comp"] = partial(r, cfg.head_dim)
    if r == 4:
        out["index_keys"] = (length // 4) * cfg.index_head_dim
        out["index_comp"] = partial(4, cfg.index_head_dim)
    return out


def sequence_state_bytes(cfg: ModelConfig, i: int, length: int, dt: StateDtypes) -> int:
    """Bytes of layer i's state for one sequence of `length` tokens."""
    if is_v41(cfg):                      # shared compressed KV, Engram history (v41/sizes.py)
        return v41_sizes.sequence_state_bytes(cfg, i, length, dt)
    e = sequence_state_elements(cfg, i, length)
    return ((e["window"] + e["comp_kv"]) * dt.kv + (e["comp"] + e["index_comp"]) * dt.compressor
            + e["index_keys"] * dt.index_keys)


def _largest_weight_numel(specs) -> int:
    return max((s.numel for s in specs), default=0)


# ---- the plan ------------------------------------------------------------------------------
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
    with its memory budget in bytes. `_advice` varies these fields to find what would fit."""
    devices: tuple[str, ...]
    budgets: tuple[int, ...]
    length: int
    prompts: int
    arms: int
    weights_mode: str = "resident-quantised"
    dequant: str = "full"
    logits_mode: str = "all"
    head_first: bool = False      # the head (and its logits) on the first device, not the last
    cached_state: int = 0         # state snapshots kept besides the pass (serve's prefix cache)
    pipeline: bool = False        # one rank per device: the stages fidelity.stages cuts

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


def plan_memory(cfg: ModelConfig, devices, length: int, prompts: int = 1, arms: int = 1,
                weights_mode: str = "resident-quantised", device_memory=None, *,
                profile="reference", dequant: str = "full", logits: str = "all",
                chunk_tokens: int = 2048,
                attn_budget: int = 1 << 25, advise: bool = True, nodes: int = 1,
                head_first: bool = False, cached_state: int = 0, pipeline: bool | None = None) -> MemoryPlan:
    """Bytes per device for a pass of `prompts` x `arms` sequences of `length` tokens (see the
    module docstring for each term). `devices`: list or comma string of cpu / cuda:N;
    `device_memory`: bytes or a size string ('96GB') per device, a list of them, or None to
    read CUDA devices' total memory. Raises PlanError on bad input. When the plan does not
    fit and `advise`, `advice` says what would: fewer prompts per pass, a shorter length,
    more devices, streamed weights, last-position logits. `nodes`: the devices are one
    node's, repeated on each of `nodes` nodes (a torchrun pipeline, fidelity.pipeline: one
    rank per device, labelled DEV@nodeK). `head_first`: the head runs on the first device
    (the per-prompt commands' pipeline, fidelity.pipeline_model: rank 0 runs it), the
    layer split unchanged; `cached_state`: bytes of state snapshots held besides the pass
    (serve's prefix cache), each device counting its layers' share of a sequence's state;
    `pipeline` (default: nodes > 1): the devices are torchrun ranks, holding the layers
    fidelity.stages.stage_ranges gives them (V4.1: cut only where no layer reads another
    stage's state)."""
    # the public entry keeps one parameter per `plan-memory` option (keyword-only past
    # device_memory); inside, they travel as PassSpec + PlanNumerics
    try:
        devices = parse_devices(devices, on_this_machine=False)
    except DeviceError as e:
        raise PlanError(str(e)) from None
    _check_modes(weights_mode, dequant, logits)
    for name, v in (("length", length), ("prompts", prompts), ("arms", arms), ("nodes", nodes)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlanError(f"{name} must be a positive integer, got {v!r}")
    if length > cfg.max_seq_len:
        raise PlanError(f"length {length} exceeds the config's max_seq_len {cfg.max_seq_len} "
                        f"(by {length - cfg.max_seq_len} tokens)")
    budgets = device_budgets(list(devices), device_memory) * nodes
    if nodes > 1:
        devices = tuple(f"{d}@node{k}" for k in range(nodes) for d in devices)
    spec = PassSpec(devices, tuple(budgets), length, prompts, arms, weights_mode, dequant, logits,
                    head_first, cached_state, nodes > 1 if pipeline is None else pipeline)
    if spec.pipeline and len(devices) > _most_stages(cfg):
        raise PlanError(too_many_ranks(cfg, len(devices), _most_stages(cfg)))
    nx = PlanNumerics(profile if isinstance(profile, StateDtypes) else state_dtypes(profile),
                      profile if isinstance(profile, str) else "custom", chunk_tokens, attn_budget)
    plan = _plan(cfg, spec, nx)
    if advise and not plan.fits:
        plan.advice = _advice(cfg, spec, nx, plan)
    return plan


def _most_stages(cfg) -> int:
    """The most pipeline ranks the layers can be cut into (fidelity.stages.segments)."""
    return len(segments(cfg))


def _check_modes(weights_mode: str, dequant: str, logits: str) -> None:
    if weights_mode not in WEIGHT_MODES:
        raise PlanError(f"unknown weights mode {weights_mode!r}; valid: {', '.join(WEIGHT_MODES)}")
    if dequant not in DEQUANT_MODES:
        raise PlanError(f"unknown dequant mode {dequant!r}; valid: {', '.join(DEQUANT_MODES)}")
    if logits not in LOGITS_MODES:
        raise PlanError(f"unknown logits mode {logits!r}; valid: {', '.join(LOGITS_MODES)}")


def _layer_table(cfg: ModelConfig) -> list[dict]:
    """Per-layer weight numbers that do not depend on the run (cached per config)."""
    key = cfg.config_hash()
    if key not in _CACHE:
        rows = []
        for i in range(cfg.n_layers):
            if is_v41(cfg):
                rows.append(v41_sizes.layer_row(cfg, i))
                continue
            specs = layer_specs(cfg, i)
            rows.append({"quantised": sum(spec_bytes(s, "quantised") for s in specs),
                         "bf16": sum(spec_bytes(s, "bf16") for s in specs),
                         "largest": _largest_weight_numel(specs),
                         "dequant": _dequant_parts(specs, i)})
        _CACHE.clear()
        _CACHE[key] = rows
    return _CACHE[key]


_CACHE: dict = {}


@dataclass(frozen=True)
class _PassSizes:
    """Byte counts of one pass that do not depend on the device."""
    table: list                   # _layer_table(cfg)
    first_g: list                 # global tensors on the first device (embed)
    last_g: list                  # global tensors on the last device (head, norms)
    wkey: str                     # "quantised" or "bf16": the resident weights' format
    state_layer: list             # one sequence's state bytes per layer
    stream_seq: int               # one sequence's residual stream
    logit_rows: int               # logits rows held per arm at once (one head chunk)
    stat_rows: int                # positions whose logit statistics are kept per arm
    act: int                      # attention / q,o workspace of one chunk


def _pass_sizes(cfg: ModelConfig, spec: PassSpec, nx: PlanNumerics) -> _PassSizes:
    dt = nx.dtypes
    chunk = min(spec.length, nx.chunk_tokens)
    gspecs = _global_specs(cfg)
    return _PassSizes(
        table=_layer_table(cfg),
        first_g=[s for s in gspecs if s.name in FIRST_GLOBALS],
        last_g=[s for s in gspecs if s.name not in FIRST_GLOBALS],
        wkey="quantised" if spec.weights_mode == "resident-quantised" else "bf16",
        state_layer=[sequence_state_bytes(cfg, i, spec.length, dt) for i in range(cfg.n_layers)],
        stream_seq=spec.length * cfg.hc_mult * cfg.dim * dt.stream,
        logit_rows=min(spec.length, nx.chunk_tokens) if spec.logits_mode == "all" else 1,
        stat_rows=spec.length if spec.logits_mode == "all" else 1,
        act=4 * chunk * cfg.n_heads * cfg.head_dim * dt.compute + nx.attn_budget * dt.compute)


def _plan(cfg: ModelConfig, spec: PassSpec, nx: PlanNumerics) -> MemoryPlan:
    sz = _pass_sizes(cfg, spec, nx)
    gspecs = _global_specs(cfg)
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


def _device_plan(cfg: ModelConfig, spec: PassSpec, nx: PlanNumerics, sz: _PassSizes,
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
        p.dequant = max((_dequant(table[i]["dequant"], cfg, spec.dequant, pass_tokens)
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


# ---- advice: what would fit ------------------------------------------------------------------
def _largest_ok(lo: int, hi: int, f) -> int | None:
    """Largest v in [lo, hi] with f(v) (f monotone: true then false), or None."""
    if not f(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if f(mid) else (lo, mid - 1)
    return lo


def _s(n: int) -> str:
    return "s" if n != 1 else ""


def _advice(cfg: ModelConfig, spec: PassSpec, nx: PlanNumerics, plan: MemoryPlan) -> list[str]:
    """One line per remedy, each tried on its own; if none fits alone, the combination."""
    def fits(**changes) -> bool:
        return _plan(cfg, replace(spec, **changes), nx).fits

    out: list[str] = []
    ok = [_advise_prompts(spec, fits, out), _advise_length(spec, fits, out),
          _advise_devices(cfg, spec, nx, fits, out)]
    if spec.weights_mode != "streamed":
        ok.append(fits(weights_mode="streamed"))
        out.append("streamed weights (--weights streamed): " + (
            "fits" if ok[-1] else "not enough on its own"))
    head = max(plan.devices, key=lambda d: d.logits)              # the device running the head
    if spec.logits_mode == "all" and head.logits > 0:
        ok.append(fits(logits_mode="last"))
        out.append(f"logits of the last position only (--logits last; prefill logit chunks "
                   f"{_gib(head.logits)} on {head.device}): "
                   + ("fits" if ok[-1] else "not enough on its own"))
    if not any(ok):
        out.append(_advise_together(spec, fits))
    return out


def _advise_prompts(spec: PassSpec, fits, out: list[str]) -> bool:
    prompts, arms = spec.prompts, spec.arms
    p = _largest_ok(1, prompts - 1, lambda v: fits(prompts=v)) if prompts > 1 else None
    if p:
        out.append(f"fewer prompts per pass: {p} prompt{_s(p)} x {arms} arm{_s(arms)} "
                   f"fit{'s' if p == 1 else ''} ({math.ceil(prompts / p)} passes for {prompts} "
                   "prompts)")
    elif prompts > 1:
        out.append("fewer prompts per pass: not enough (1 prompt per pass does not fit either)")
    return bool(p)


def _advise_length(spec: PassSpec, fits, out: list[str]) -> bool:
    length, prompts, arms = spec.length, spec.prompts, spec.arms
    n = _largest_ok(1, length - 1, lambda v: fits(length=v)) if length > 1 else None
    out.append(f"shorter length: up to {n} tokens fit with {prompts} prompts x {arms} arms"
               if n else f"shorter length: not enough (1 token does not fit with {prompts} "
                         f"prompts x {arms} arms)")
    return bool(n)


def _advise_devices(cfg: ModelConfig, spec: PassSpec, nx: PlanNumerics, fits, out: list[str]) -> bool:
    """The smallest count of devices like the smallest one that fits (up to one per layer)."""
    kind = "cpu" if all(d == "cpu" for d in spec.devices) else "cuda"
    budget, have = min(spec.budgets), len(spec.devices)

    def devs(m: int) -> tuple[str, ...]:
        return ("cpu",) * m if kind == "cpu" else tuple(f"cuda:{j}" for j in range(m))

    cap = max(have, _most_stages(cfg) if spec.pipeline else cfg.n_layers)
    more = _largest_ok(-cap, -(have + 1),
                       lambda v: fits(devices=devs(-v), budgets=(budget,) * -v)) \
        if cap > have else None                  # negated: the smallest count that fits
    if more is not None:
        out.append(f"more devices: {-more} x {_size(budget)} fit (pipeline over {-more} devices)")
        return True
    w = _plan(cfg, replace(spec, devices=devs(cap), budgets=(budget,) * cap), nx).tightest
    out.append(f"more devices: not enough (with {cap} devices of {_size(budget)}, "
               f"{w.device} still needs {_gib(w.total)}: logits {_gib(w.logits)}, streams "
               f"{_gib(w.streams)}, workspace {_gib(w.workspace)}, weights {_gib(w.weights)})")
    return False


def _advise_together(spec: PassSpec, fits) -> str:
    both = dict(weights_mode="streamed", logits_mode="last")
    p = _largest_ok(1, spec.prompts, lambda v: fits(prompts=v, **both))
    if p == spec.prompts:
        return "together: streamed weights and last-position logits fit"
    if p:
        return f"together: streamed weights, last-position logits and {p} prompt{_s(p)} per pass fit"
    return ("together: streamed weights, last-position logits and 1 prompt per pass "
            "do not fit either")


# ---- rendering --------------------------------------------------------------------------------
def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _size(n: int) -> str:
    """A budget in both units: '89.41 GiB (96 GB)'."""
    return f"{n / GiB:.2f} GiB ({n / 1e9:g} GB)" if n % 10**6 == 0 else _gib(n)


def _g(n: int) -> str:
    return f"{n / GiB:.2f}"


def _layer_span(layers: list[int]) -> str:
    if not layers:
        return "-"
    return f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"


def describe(plan: MemoryPlan) -> str:
    """One paragraph: the run being planned."""
    dt = plan.dtypes
    names = {1: "1 B", 2: "2 B", 4: "4 B", 8: "8 B"}
    return (f"{plan.model}: {plan.n_layers} layers, length {plan.length} tokens, "
            f"{plan.prompts} prompt{'s' if plan.prompts != 1 else ''} x {plan.arms} "
            f"arm{'s' if plan.arms != 1 else ''} = {plan.sequences} sequences per pass, "
            f"weights {plan.weights_mode}"
            + (f" (dequant {plan.dequant})" if plan.weights_mode == "resident-quantised" else "")
            + f", profile {plan.profile} (state kv {names.get(dt.kv, dt.kv)}, compressor "
            f"{names.get(dt.compressor, dt.compressor)}, indexer keys "
            f"{names.get(dt.index_keys, dt.index_keys)}, stream {names.get(dt.stream, dt.stream)}"
            f" per element), logits {plan.logits_mode}, layers balanced on weight bytes.")


def per_sequence_line(plan: MemoryPlan) -> str:
    ps = plan.per_sequence
    kinds = ", ".join(f"{k} {_gib(v['bytes'])} ({v['layers']} layers)"
                      for k, v in ps["state_by_kind"].items())
    return (f"Per sequence of {plan.length} tokens: state {_gib(ps['state'])} ({kinds}); "
            f"residual stream {_gib(ps['stream'])}; logits {_gib(ps['logits'])}.")


def host_mapped_line(plan: MemoryPlan) -> str:
    return (f"Host, memory-mapped: Engram tables {_gib(plan.totals['host_mapped'])}, read from "
            "the checkpoint files in place (only the rows each token gathers move to its "
            "layer's device); not counted on any device.")


def render(plan: MemoryPlan, title: str | None = None, full: bool = True) -> str:
    """Markdown: the run and per-sequence sizes (full), one row per device (GiB), the
    verdict and what would fit."""
    L = []
    if title:
        L += [title, ""]
    if full:
        L += [describe(plan), "", per_sequence_line(plan), ""]
        if plan.totals.get("host_mapped"):
            L += [host_mapped_line(plan), ""]
    L += ["| device | layers | globals | weights | dequant | state | streams | logits | "
          "workspace | total | budget | free |",
          "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for d in plan.devices:
        g = ", ".join(n.split(".")[0] if n.endswith(".weight") else n for n in d.globals
                      if n in ("embed.weight", "head.weight")) or "-"
        free = _g(d.free) if d.fits else f"**{_g(d.free)}**"
        L.append(f"| {d.device} | {_layer_span(d.layers)} | {g} | {_g(d.weights)} | "
                 f"{_g(d.dequant)} | {_g(d.state)} | {_g(d.streams)} | {_g(d.logits)} | "
                 f"{_g(d.workspace)} | {_g(d.total)} | {_g(d.budget)} | {free} |")
    budgets = sorted({d.budget for d in plan.devices})
    if full:
        L += ["", f"(GiB = 2^30 bytes; budget {', '.join(_size(b) for b in budgets)} per device)"]
    L.append("")
    L.append(verdict(plan))
    L += [f"  - {a}" for a in plan.advice]
    return "\n".join(L)


def verdict(plan: MemoryPlan) -> str:
    t = plan.tightest
    if plan.fits:
        return (f"FITS: tightest device {t.device} uses {_gib(t.total)} of {_gib(t.budget)} "
                f"({_gib(t.free)} free).")
    over = [d for d in plan.devices if not d.fits]
    worst = ", ".join(f"{d.device} needs {_gib(d.total)} of {_gib(d.budget)} (over by "
                      f"{_gib(-d.free)})" for d in over)
    return f"DOES NOT FIT: {worst}. What would fit:"
