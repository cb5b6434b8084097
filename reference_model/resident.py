"""A checkpoint kept resident in its own formats and dequantised on use.

`QuantisedResidentWeights` holds every tensor as stored (FP8 e4m3 + E8M0 block scales,
FP4 packed pairs + E8M0 scales, bf16 / f32 / i64 as they are) on its layer's device: about
a quarter of the dequantised size, so V4-Flash (145 GiB on disk) fits where its 530 GiB
bf16 form does not. A layer's tensors are dequantised the first time a pass touches them
and dropped when the next layer is asked for; the routed experts of an MoE layer are
decoded only if some token is routed to them (the layer is a lazy mapping, and the MoE
code reads only routed experts' weights). Values are exactly the streamed / in-memory
paths' (same decoders), so logits are bit-identical. DeepSeek-V4.1 checkpoints:
reference_model/v41/resident.py (the same class with V4.1's reader, grids and placement)."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from .checkpoint_format import disk_entries
from .checkpoint_read import CheckpointInfo, _ShardReader, decode_raw, scan_checkpoint, validate_raw
from .config import ModelConfig
from .placement import model_placement
from .specs import global_specs, layer_specs


class LazyLayer(Mapping):
    """One layer's weights by stripped name, each decoded on first access and kept until
    the layer is released. `placed`: the tensors already sit on the layer's device."""

    placed = True

    def __init__(self, src: "QuantisedResidentWeights", i: int):
        self.src, self.i = src, i
        self.raw = src.raw_layers[i]
        self.cache: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.cache:
            spec, raw = self.raw[name]
            self.cache[name] = self.src.decode(spec, raw, self.src.device_of(self.i))
            self.src.decoded[spec.fmt] = self.src.decoded.get(spec.fmt, 0) + 1
        return self.cache[name]

    def __iter__(self):
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)


class QuantisedResidentWeights:
    """WeightSource: the checkpoint's own tensors resident, dequantised on use (see the
    module docstring). `devices`: the same contiguous placement Model(devices=...) uses;
    `decoded` counts decoded tensors per format, `loads` the layers handed out."""

    resident = False          # Model must not keep dense converted copies

    def __init__(self, path, device="cpu", cfg: ModelConfig | None = None, devices=None,
                 io_chunk_bytes: int = 64 << 20, layers: range | None = None):
        self.info = path if isinstance(path, CheckpointInfo) else self.scan(path, cfg)
        self.cfg = self.info.cfg
        self.devices = [torch.device(d) for d in devices] if devices else [torch.device(device)]
        self._owner = (self.placement(len(self.devices)) if len(self.devices) > 1
                       else [0] * self.cfg.n_layers)
        reader = _ShardReader(self.info.root, io_chunk_bytes)
        try:
            self.raw_globals = self._read(reader, self.specs(None), "", self.devices[0])
            # a pipeline stage (fidelity.pipeline) reads only its own layers
            self.layers = range(self.cfg.n_layers) if layers is None else layers
            self.raw_layers = [self._read(reader, self.specs(i), f"layers.{i}.", self.device_of(i))
                               if i in self.layers else None for i in range(self.cfg.n_layers)]
        finally:
            reader.close()
        self._globals: dict | None = None
        self._layer: LazyLayer | None = None
        self.decoded: dict[str, int] = {}
        self.loads = 0

    # ---- what depends on the model version (v41/resident.py overrides these) ------------
    @staticmethod
    def scan(path, cfg):
        return scan_checkpoint(path, cfg)

    def placement(self, n_devices: int) -> list[int]:
        """Each layer's device index, as the model places them."""
        return model_placement(self.cfg, n_devices)

    def specs(self, i: int | None) -> list:
        """Layer i's tensor specs (None: the globals)."""
        return global_specs(self.cfg) if i is None else layer_specs(self.cfg, i)

    def read_raw(self, reader, s) -> dict:
        """A tensor's stored entries by role, validated (bad data is a named error)."""
        raw = {e.role: reader.get(self.info.tensors[e.name])
               for e in disk_entries(s, self.info.layout, self.info.float_dtype)}
        validate_raw(self.info, s, raw)
        return raw

    def host_mapped(self, s) -> bool:
        """Kept memory-mapped on the host instead of copied to the layer's device."""
        return False

    def decode(self, s, raw: dict, device):
        """A tensor in the in-memory form from its stored entries."""
        return decode_raw(s, raw, device)

    # ---- the weight source --------------------------------------------------------------------
    def _read(self, reader, specs, strip: str, device) -> dict:
        out = {}
        for s in specs:
            raw = self.read_raw(reader, s)
            if not self.host_mapped(s):
                raw = {k: v.to(device, copy=True) for k, v in raw.items()}
            out[s.name[len(strip):]] = (s, raw)
        return out

    def device_of(self, i: int) -> torch.device:
        return self.devices[self._owner[i]]

    @property
    def resident_bytes(self) -> int:
        """Bytes held resident on the devices (the checkpoint's own formats; host-mapped
        tensors not counted)."""
        return sum(t.numel() * t.element_size() for part in [self.raw_globals, *self.raw_layers]
                   if part is not None for s, raw in part.values() if not self.host_mapped(s)
                   for t in raw.values())

    def global_weights(self) -> dict[str, torch.Tensor]:
        if self._globals is None:
            self._globals = {k: self.decode(s, raw, self.devices[0]) for k, (s, raw) in self.raw_globals.items()}
        return self._globals

    def layer_weights(self, i: int) -> LazyLayer:
        if not 0 <= i < self.cfg.n_layers:
            raise IndexError(f"layer {i} out of range 0..{self.cfg.n_layers - 1}")
        if self.raw_layers[i] is None:
            raise IndexError(f"layer {i} was not read: this source holds layers "
                             f"{self.layers.start}-{self.layers.stop - 1} only (a pipeline stage)")
        if self._layer is None or self._layer.i != i:
            self._layer = None                              # free the previous layer's decode
            self._layer = LazyLayer(self, i)
            self.loads += 1
        return self._layer
