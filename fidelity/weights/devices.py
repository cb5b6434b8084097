"""Where the golden runs: a device list (layers placed contiguously across it in one
process: pipeline placement, the simplest thing that serves one 8-GPU node), the
accumulation dtype (fp64 where the hardware has fast fp64, fp32 otherwise: consumer GPUs
run fp64 at 1/64 rate), and CPU threads. Several nodes would need torch.distributed and
an existing engine's parallelism, not this."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from fidelity.weights.source import WEIGHT_MODES

# compute capabilities whose fp64 runs at half (or better) the fp32 rate: P100, V100,
# A100 / A30, H100 / H200, B200 / B300 (data-centre parts)
FAST_FP64 = {(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)}


class DeviceError(ValueError):
    """A device list, or an accumulation dtype, that cannot be used."""


@dataclass(frozen=True)
class Placement:
    devices: tuple[str, ...] = ("cpu",)
    compute_dtype: torch.dtype = torch.float64

    @property
    def model_devices(self) -> list[str] | None:
        """Model(devices=...): None for the plain single-CPU case (no transfers)."""
        return None if self.devices == ("cpu",) else list(self.devices)

    def describe(self) -> dict:
        return {"devices": list(self.devices), "accumulate": str(self.compute_dtype).replace("torch.", "")}


_DEVICE = re.compile(r"cpu|cuda(?::(\d+))?")


def parse_devices(text: str | list[str] | tuple[str, ...] | None, *,
                  on_this_machine: bool = True) -> tuple[str, ...]:
    """'cpu', 'cuda', 'cuda:N', comma-separated (or a list); None or '' is cpu, 'cuda' is
    cuda:0. cpu may repeat (the transfer path, or several host-memory budgets); a CUDA device
    may be listed once. `on_this_machine`: each CUDA device must exist here (a run); False
    checks the spelling only (`plan-memory` plans for machines you may not have).
    Raises DeviceError."""
    items = (text or "cpu").split(",") if text is None or isinstance(text, str) else list(text)
    out: list[str] = []
    for raw in (x.strip() for x in items):
        if not raw:
            continue
        m = _DEVICE.fullmatch(raw.lower())
        if not m:
            raise DeviceError(f"--devices: unknown device {raw!r}: not a device this runs on; use "
                              "cpu, cuda or cuda:N (comma-separated, e.g. cuda:0,cuda:1)")
        d = "cpu" if raw.lower() == "cpu" else f"cuda:{int(m[1] or 0)}"
        if d != "cpu" and d in out:
            raise DeviceError(f"--devices: {d} is listed twice")
        out.append(d)
    if not out:
        raise DeviceError("--devices is empty")
    if on_this_machine:
        _check_present(out)
    return tuple(out)


def _check_present(devices: list[str]) -> None:
    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for d in devices:
        if d.startswith("cuda:") and int(d.split(":")[1]) >= n_cuda:
            raise DeviceError(f"--devices: {d} does not exist: this machine has {n_cuda} CUDA "
                              f"device(s)" + (" (torch was built without CUDA)" if not torch.version.cuda else ""))


def has_fast_fp64(device: str) -> bool:
    if not device.startswith("cuda"):
        return True
    return torch.cuda.get_device_capability(torch.device(device)) in FAST_FP64


def accumulate_dtype(devices, choice: str = "auto") -> torch.dtype:
    if choice == "fp64":
        return torch.float64
    if choice == "fp32":
        return torch.float32
    if choice != "auto":
        raise DeviceError(f"--accumulate must be auto, fp64 or fp32, got {choice!r}")
    return torch.float64 if all(has_fast_fp64(d) for d in devices) else torch.float32


def arithmetic() -> dict:
    """The machine a run's float32 floors were computed on, for its manifest: torch's CPU
    vector dispatch, threads, processor and GPU. The same code and data gave the QAT-free
    fp32 floor 38% apart on two machines while every fp64 arm matched to 1e-15
    (bench/results/floors_by_machine.md): the cause is not found yet, and without this
    record two runs could not even be told apart."""
    import platform
    cuda = torch.cuda.is_available()
    return {"torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "machine": platform.machine(), "processor": _cpu_model(),
            "gpu": torch.cuda.get_device_name(0) if cuda else None}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        import platform
        return platform.processor()


def default_threads() -> int:
    """The machine's cores not already busy (1-minute load average), at least one: all
    cores on an idle machine, one when other jobs share it."""
    n = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except OSError:
        busy = 0.0
    return max(1, min(n, round(n - busy)))


def add_options(p) -> None:
    g = p.add_argument_group("devices")
    g.add_argument("--devices", "--device", dest="devices", default=None, metavar="DEV[,DEV...]",
                   help="where the golden runs: cpu (default), cuda, cuda:0,...,cuda:7 (layers "
                        "placed contiguously across the list)")
    g.add_argument("--weights-mode", default=None, choices=WEIGHT_MODES,
                   help="how a --checkpoint is held: streamed (one dequantised layer at a time; "
                        "default for ab), resident-quantised (the checkpoint's own FP8/FP4 "
                        "tensors resident, dequantised on use), dense (default for serve, "
                        "needle, kld)")
    g.add_argument("--accumulate", default="auto", choices=("auto", "fp64", "fp32"),
                   help="accumulation dtype of the reference numerics: auto = fp64 where the "
                        "devices have fast fp64 (CPU, data-centre GPUs), fp32 otherwise")


def from_args(args) -> Placement:
    devs = parse_devices(getattr(args, "devices", None))
    return Placement(devs, accumulate_dtype(devs, getattr(args, "accumulate", "auto")))
