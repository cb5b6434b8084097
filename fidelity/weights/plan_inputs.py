"""What `plan-memory` accepts, checked before any arithmetic: the modes, sizes as people
write them, each device's byte budget, and PlanError for input that is none of these (kept
apart so every plan module can raise it without importing the plan itself)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sizes import parse_bytes

WEIGHT_MODES = ("resident-quantised", "resident-bf16", "streamed")
DEQUANT_MODES = ("full", "expert-sparse")
PROFILES = ("reference", "reference-fp32", "exact")
LOGITS_MODES = ("all", "last")


class PlanError(ValueError):
    """Bad input to a memory plan (device string, length, counts, config, size)."""


@dataclass(frozen=True)
class PlanDevices:
    """The devices a plan is asked for, as people write them: plan_memory parses and sizes them."""
    devices: object               # list or comma string of cpu / cuda:N
    memory: object = None         # bytes or a size string ('96GB') per device, a list, or None: CUDA's
    nodes: int = 1                # the devices are one node's, repeated on each node (torchrun)


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


def check_modes(weights_mode: str, dequant: str, logits: str) -> None:
    if weights_mode not in WEIGHT_MODES:
        raise PlanError(f"unknown weights mode {weights_mode!r}; valid: {', '.join(WEIGHT_MODES)}")
    if dequant not in DEQUANT_MODES:
        raise PlanError(f"unknown dequant mode {dequant!r}; valid: {', '.join(DEQUANT_MODES)}")
    if logits not in LOGITS_MODES:
        raise PlanError(f"unknown logits mode {logits!r}; valid: {', '.join(LOGITS_MODES)}")
