"""Where the golden runs: a device list (layers placed contiguously across it in one
process: pipeline placement, the simplest thing that serves one 8-GPU node), the
accumulation dtype (fp64 where the hardware has fast fp64, fp32 otherwise: consumer GPUs
run fp64 at 1/64 rate), and CPU threads. Several nodes would need torch.distributed and
an existing engine's parallelism, not this."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# compute capabilities whose fp64 runs at half (or better) the fp32 rate: P100, V100,
# A100 / A30, H100 / H200, B200 / B300 (data-centre parts)
FAST_FP64 = {(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)}


class DeviceError(ValueError):
    pass


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


def parse_devices(text: str | None) -> tuple[str, ...]:
    """'cpu', 'cuda', 'cuda:0,cuda:1', ...: each one must exist on this machine."""
    items = [x.strip() for x in (text or "cpu").split(",") if x.strip()]
    if not items:
        raise DeviceError("--devices is empty")
    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out = []
    for d in items:
        try:
            dev = torch.device(d)
        except RuntimeError as e:
            raise DeviceError(f"--devices: {d!r} is not a device ({e})") from None
        if dev.type == "cuda":
            idx = 0 if dev.index is None else dev.index
            if idx >= n_cuda:
                raise DeviceError(f"--devices: {d} does not exist: this machine has {n_cuda} CUDA "
                                  f"device(s)" + (" (torch was built without CUDA)" if not torch.version.cuda else ""))
            out.append(f"cuda:{idx}")
        elif dev.type == "cpu":
            out.append("cpu")
        else:
            raise DeviceError(f"--devices: {d}: only cpu and cuda devices are supported")
    return tuple(out)


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
    g.add_argument("--weights-mode", default=None, choices=("streamed", "resident-quantised", "dense"),
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
