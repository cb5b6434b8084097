"""A DeepSeek-V4.1 checkpoint kept resident in its own formats and dequantised on use:
V4's QuantisedResidentWeights (reference_model/resident.py) with V4.1's reader (32x32 FP8
blocks, FP4 experts), tensor table and layer placement. The Engram tables are not copied to
any device: they stay memory-mapped on the host and only gathered rows move (EngramTable).
Same decoders as the dense and streamed loads, so logits are bit-identical."""
from __future__ import annotations

from ..resident import QuantisedResidentWeights
from . import checkpoint_read as R
from .sizes import v41_placement
from .specs import ENGRAM_TABLE, global_specs, layer_specs


class V41QuantisedResidentWeights(QuantisedResidentWeights):
    """WeightSource over a V4.1 checkpoint, resident in checkpoint form (see the module
    docstring); the constructor arguments and counters are V4's."""

    @staticmethod
    def scan(path, cfg):
        return R.scan_checkpoint(path, cfg)

    def placement(self, n_devices: int) -> list[int]:
        return v41_placement(self.cfg, n_devices)

    def specs(self, i: int | None) -> list:
        return global_specs(self.cfg) if i is None else layer_specs(self.cfg, i)

    def read_raw(self, reader, s) -> dict:
        return R.read_raw(self.info, s, reader)

    def host_mapped(self, s) -> bool:
        return s.fmt == ENGRAM_TABLE

    def decode(self, s, raw: dict, device):
        return R.decode_raw(self.info, s, raw, device)


__all__ = ["V41QuantisedResidentWeights"]
