"""Pipeline placement of the layers over a device list: contiguous ranges, balanced on
the bytes each device holds (a layer's weights in memory, plus the embedding on the first
device and the final norm / mHC head / lm head on the last). Shared by Model(devices=...)
and `fidelity plan-memory`, so the plan describes the placement that runs."""
from __future__ import annotations

from .config import ModelConfig
from .specs import BF16, F32, FP4, FP8, I64, global_specs, layer_specs

MEM_BYTES = {FP8: 2, FP4: 2, BF16: 2, F32: 4, I64: 8}      # held dequantised (bf16)


def layer_bytes(cfg: ModelConfig) -> list[int]:
    """Each layer's weights as held in memory (quantised formats dequantised to bf16)."""
    return [sum(s.numel * MEM_BYTES[s.fmt] for s in layer_specs(cfg, i)) for i in range(cfg.n_layers)]


def end_bytes(cfg: ModelConfig) -> tuple[int, int]:
    """(bytes on the first device: the embedding, bytes on the last: everything else global)."""
    first = last = 0
    for s in global_specs(cfg):
        b = s.numel * MEM_BYTES[s.fmt]
        if s.name.startswith("embed"):
            first += b
        else:
            last += b
    return first, last


def model_placement(cfg: ModelConfig, n_devices: int) -> list[int]:
    """The device index of every layer."""
    first, last = end_bytes(cfg)
    owner = [0] * cfg.n_layers
    for k, r in enumerate(place_layers(layer_bytes(cfg), n_devices, first, last)):
        for i in r:
            owner[i] = k
    return owner


def place_layers(layer_bytes: list[int], n_devices: int, first_extra: int = 0,
                 last_extra: int = 0, nonempty: bool = False) -> list[range]:
    """Contiguous split of the layers over n_devices: the smallest possible largest
    per-device sum (layer bytes + the globals each end device holds), and among the splits
    that reach it the most even one (least sum of squared loads). Exact DP; devices past the
    layer count get empty ranges. `nonempty` (n_devices <= the layer count): every device
    gets at least one (a pipeline rank with no layer would only forward the streams)."""
    n, D = len(layer_bytes), n_devices
    pre = [0]
    for b in layer_bytes:
        pre.append(pre[-1] + b)
    least = int(nonempty)                   # layers each device holds at least

    def load(k, a, b):
        if b - a < least:
            return float("inf")
        extra = (first_extra if k == 0 else 0) + (last_extra if k == D - 1 else 0)
        return pre[b] - pre[a] + extra

    INF = float("inf")
    # 1) best[k][i]: least max load placing layers[:i] on devices 0..k
    best = [[load(0, 0, i) for i in range(n + 1)]] + [[INF] * (n + 1) for _ in range(D - 1)]
    for k in range(1, D):
        for i in range(n + 1):
            best[k][i] = min(max(best[k - 1][j], load(k, j, i)) for j in range(i + 1))
    cap = best[D - 1][n]
    # 2) among splits with every load <= cap, the least sum of squared loads
    ss = [[load(0, 0, i) ** 2 if load(0, 0, i) <= cap else INF for i in range(n + 1)]]
    cut = [[0] * (n + 1) for _ in range(D)]
    for k in range(1, D):
        row = [INF] * (n + 1)
        for i in range(n + 1):
            for j in range(i + 1):
                ld = load(k, j, i)
                if ld <= cap and ss[k - 1][j] + ld * ld < row[i]:
                    row[i], cut[k][i] = ss[k - 1][j] + ld * ld, j
        ss.append(row)
    ranges, i = [], n
    for k in range(D - 1, 0, -1):
        j = cut[k][i]
        ranges.append(range(j, i))
        i = j
    ranges.append(range(0, i))
    return ranges[::-1]
