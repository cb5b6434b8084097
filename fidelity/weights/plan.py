"""Memory plan for a lockstep run of the golden model on a set of devices, from the config
alone (shape arithmetic over the tensor table; nothing is loaded or allocated).

`plan_memory(cfg, PlanDevices(devices, memory), PassSpec(length, prompts, arms, ...))`
places the layers contiguously over the devices (pipeline placement, weight bytes balanced;
embed on the first device, the head on the last) and returns a `MemoryPlan`: bytes per
device for

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
`even` is Model(devices=...)'s rule, layer i on device i·D // n_layers.

The parts: plan_inputs (modes, sizes, budgets, PlanError), plan_layers (bytes per tensor,
layer and sequence), plan_devices (the pass placed on its devices), plan_advice (what would
fit), plan_render (the plan as text). This module is the entry, `plan_memory`, and keeps
their public names importable from here."""
from __future__ import annotations

from dataclasses import replace

from fidelity.weights.devices import DeviceError, parse_devices
from fidelity.weights.stages import too_many_ranks
from reference_model.config import ModelConfig

from .plan_advice import advice
from .plan_devices import (DevicePlan, MemoryPlan, PassSpec, PlanNumerics, most_stages,
                           plan_pass)
from .plan_inputs import (DEQUANT_MODES, LOGITS_MODES, PROFILES, WEIGHT_MODES, PlanDevices,
                          PlanError, check_modes, device_budgets, parse_size)
from .plan_layers import (StateDtypes, dequant_buffer_bytes, layer_weight_bytes,
                          sequence_state_bytes, sequence_state_elements, spec_bytes,
                          state_dtypes)
from .plan_render import GiB, describe, host_mapped_line, per_sequence_line, render, verdict

__all__ = ["DEQUANT_MODES", "LOGITS_MODES", "PROFILES", "WEIGHT_MODES", "GiB", "DevicePlan",
           "MemoryPlan", "PassSpec", "PlanDevices", "PlanError", "PlanNumerics", "StateDtypes",
           "dequant_buffer_bytes", "describe", "device_budgets", "host_mapped_line",
           "layer_weight_bytes", "parse_size", "per_sequence_line", "plan_memory", "render",
           "sequence_state_bytes", "sequence_state_elements", "spec_bytes", "state_dtypes",
           "verdict"]


def plan_memory(cfg: ModelConfig, where: PlanDevices, spec: PassSpec,
                numerics: PlanNumerics | None = None, advise: bool = True) -> MemoryPlan:
    """Bytes per device for a pass of `spec.prompts` x `spec.arms` sequences of `spec.length`
    tokens (see the module docstring for each term) on `where`: its devices (list or comma
    string of cpu / cuda:N), their memory (bytes or a size string ('96GB') per device, a
    list of them, or None to read CUDA devices' total memory) and `nodes`: the devices are
    one node's, repeated on each of `nodes` nodes (a torchrun pipeline, fidelity.pipeline:
    one rank per device, labelled DEV@nodeK). `spec.devices` and `spec.budgets` are filled
    in from `where`. Raises PlanError on bad input. When the plan does not fit and `advise`,
    `advice` says what would: fewer prompts per pass, a shorter length, more devices,
    streamed weights, last-position logits. `spec.head_first`: the head runs on the first
    device (the per-prompt commands' pipeline, fidelity.pipeline.model: rank 0 runs it),
    the layer split unchanged; `spec.cached_state`: bytes of state snapshots held besides
    the pass (serve's prefix cache), each device counting its layers' share of a sequence's
    state; `spec.pipeline` (None: nodes > 1): the devices are torchrun ranks, holding the
    layers fidelity.weights.stages.stage_ranges gives them (V4.1: cut only where no layer reads
    another stage's state). `numerics`: PlanNumerics.of(profile) (default: reference)."""
    try:
        devices = parse_devices(where.devices, on_this_machine=False)
    except DeviceError as e:
        raise PlanError(str(e)) from None
    check_modes(spec.weights_mode, spec.dequant, spec.logits_mode)
    nodes = where.nodes
    for name, v in (("length", spec.length), ("prompts", spec.prompts), ("arms", spec.arms),
                    ("nodes", nodes)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlanError(f"{name} must be a positive integer, got {v!r}")
    if spec.length > cfg.max_seq_len:
        raise PlanError(f"length {spec.length} exceeds the config's max_seq_len {cfg.max_seq_len} "
                        f"(by {spec.length - cfg.max_seq_len} tokens)")
    budgets = device_budgets(list(devices), where.memory) * nodes
    if nodes > 1:
        devices = tuple(f"{d}@node{k}" for k in range(nodes) for d in devices)
    spec = replace(spec, devices=tuple(devices), budgets=tuple(budgets),
                   pipeline=nodes > 1 if spec.pipeline is None else spec.pipeline)
    if spec.pipeline and len(devices) > most_stages(cfg):
        raise PlanError(too_many_ranks(cfg, len(devices), most_stages(cfg)))
    nx = numerics or PlanNumerics.of()
    plan = plan_pass(cfg, spec, nx)
    if advise and not plan.fits:
        plan.advice = advice(cfg, spec, nx, plan)
    return plan
