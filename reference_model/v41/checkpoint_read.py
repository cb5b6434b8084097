"""Read and validate a DeepSeek-V4.1 checkpoint (docs/v41-architecture.md §6, §11) from its
shard headers, then hand out weights in the in-memory form of v41/weights.py.

V4's reader does the shard and index work (`_shard_files`, `_read_headers`, `_check_index`,
`_ShardReader`, CheckpointInfo); this module checks the result against the V4.1 table and
names what V4.1 ports got wrong: a V4 checkpoint labelled V4.1 (one headline, not a
thousand missing tensors), 128x128 scale grids where 32x32 are expected, Engram tables whose
rows disagree with `engram_num_embeddings`, or scales that do not fit the table."""
from __future__ import annotations

import json
import logging
import mmap
from pathlib import Path

import torch

from .. import quant as Q
from ..checkpoint_format import CheckpointError, natural_key
from ..checkpoint_read import _config, _hints
from ..checkpoint_shards import (CheckpointInfo, LayerStream, _check_index, _find_config, _read_headers,
                                 _shard_files, _ShardReader)
from ..specs import BF16, F32
from .checkpoint_format import (block128_scale, disk_entries, expected_entries, v4_signatures,
                                v41_signatures)
from .config import V41Config, from_dict, is_v41_dict
from .specs import ENGRAM_TABLE, FP8_32, TensorSpec, all_specs, global_specs, is_skipped, layer_specs
from .weights import EngramTable, V41Weights

log = logging.getLogger(__name__)


def is_v41_checkpoint(path) -> bool:
    """Does the directory's config.json (or inference/config.json) describe DeepSeek-V4.1?"""
    root = Path(path)
    root = root.parent if root.is_file() else root
    p = _find_config(root) if root.is_dir() else None
    if p is None:
        return False
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and is_v41_dict(raw)


def quant_problems(raw: dict) -> list[str]:
    """V4.1 is FP8 e4m3 with ue8m0 scales (32x32, checked by the config reader) and FP4
    experts; anything else is named."""
    errs = []
    qc = raw.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        return [f"config: quantization_config is not an object: {qc!r}"]
    qc = qc or {}
    for k, v in {"scale_fmt": "ue8m0", "quant_method": "fp8"}.items():
        if qc.get(k, v) != v:
            errs.append(f"config: quantization_config.{k} is {qc[k]!r}; only {v!r} is supported")
    ed = qc.get("expert_dtype", raw.get("expert_dtype", "fp4"))
    if ed != "fp4":
        errs.append(f"config: expert_dtype is {ed!r}; only 'fp4' is supported")
    return errs


def _fmt(e) -> str:
    return f"{e.dtype} {list(e.shape)}"


def _check_tensors(cfg: V41Config, main: dict, lost: set[str], problems: list[str]) -> dict:
    """Main tensors against the V4.1 table: a V4 checkpoint is one headline; otherwise
    missing, unexpected, wrong dtype or shape (with the 128-grid and Engram-row hints)."""
    want = expected_entries(cfg)
    v4 = v4_signatures(main)
    if v4 and not v41_signatures(main):
        n_miss = len(set(want) - set(main) - lost)
        n_extra = len(set(main) - set(want))
        problems.append(f"config says DeepSeek-V4.1 but tensors are DeepSeek-V4 ({', '.join(v4)}); "
                        f"{n_miss} V4.1 tensors missing and {n_extra} unexpected, not listed")
        return want
    if v4:
        problems += [f"V4 tensor in a V4.1 checkpoint: {s}" for s in v4]
    specs = {}
    for s in all_specs(cfg):
        for e in disk_entries(s, cfg.weight_block_size):
            specs[e.name] = (s, e)
    for name in sorted(set(want) - set(main) - lost, key=natural_key):
        problems.append(f"missing tensor: {name} ({_fmt(want[name])})")
    for name in sorted(set(main) - set(want), key=natural_key):
        problems.append(f"unexpected tensor: {name} ({_fmt(main[name])}) in {main[name].file}")
    for name in sorted(set(main) & set(want), key=natural_key):
        h, e = main[name], want[name]
        if h.dtype != e.dtype:
            problems.append(f"wrong dtype: {name}: expected {e.dtype}, found {h.dtype} in {h.file}")
        if tuple(h.shape) != tuple(e.shape):
            problems.append(_shape_problem(cfg, name, specs[name][0], e, h))
    return want


def _shape_problem(cfg: V41Config, name: str, spec: TensorSpec, e, h) -> str:
    msg = f"wrong shape: {name}: expected {list(e.shape)}, found {list(h.shape)} in {h.file}"
    if block128_scale(e, spec, h.shape):
        return (f"{msg}: a 128x128 scale grid (DeepSeek-V4's); V4.1 weights have 32x32 blocks "
                f"(quantization_config.weight_block_size {[cfg.weight_block_size] * 2})")
    if spec.fmt == ENGRAM_TABLE and e.role == "weight" and h.shape and h.shape[0] != e.shape[0]:
        layer = int(name.split(".")[1])
        return (f"{msg}: the table has {h.shape[0]} rows but engram_num_embeddings says "
                f"{e.shape[0]} for layer {layer} (hash buckets would index past or short of it)")
    if spec.fmt == ENGRAM_TABLE and e.role == "scale":
        return f"{msg}: Engram rows carry one E8M0 scale per 32 channels ([rows, head_dim/32])"
    return msg


def scan_checkpoint(path, cfg: V41Config | None = None, strict: bool = True) -> CheckpointInfo:
    """Config + every shard header checked against the V4.1 table. strict: raise one
    CheckpointError listing every problem; otherwise they are in `info.problems`."""
    root = Path(path)
    if root.is_file():
        root = root.parent
    if not root.is_dir():
        raise CheckpointError(str(root), ["checkpoint directory does not exist"])
    problems: list[str] = []
    notes: list[str] = []
    cfg, config_file = _config(root, cfg, problems, notes, parse=from_dict, quant=quant_problems)
    wm, files, total = _shard_files(root, problems)
    headers, bad_files = _read_headers(root, files, wm, problems)
    if wm is not None:
        _check_index(wm, headers, bad_files, total, problems, notes)
    skipped = {n: h for n, h in headers.items() if is_skipped(n)}
    main = {n: h for n, h in headers.items() if not is_skipped(n)}
    if skipped:
        kinds = sorted({n.split(".")[0] if not n.startswith("mtp.") else ".".join(n.split(".")[:2])
                        for n in skipped}, key=natural_key)
        notes.append(f"skipped {len(skipped)} draft/vision tensors ({', '.join(kinds)}): not part "
                     "of the text backbone")
    lost = {n for n, f in (wm or {}).items() if f in bad_files}
    want = _check_tensors(cfg, main, lost, problems)
    if set(main) != set(want) and not any(p.startswith("config says") for p in problems):
        problems += _hints(cfg, set(main) - lost)
    info = CheckpointInfo(root, cfg, config_file, main, skipped, files, total, notes, problems)
    for n in notes:
        log.info("%s: %s", root, n)
    if strict and problems:
        raise CheckpointError(f"checkpoint {root}", problems)
    return info


# ---- decoding -----------------------------------------------------------------------------
def _bad(info, name, why):
    raise CheckpointError(f"checkpoint {info.root}", [f"bad data: {name} in {info.tensors[name].file}: {why}"])


_MAPPED_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu}


def map_entry(root: Path, h) -> torch.Tensor:
    """One safetensors entry as a tensor over a private memory map of just its pages:
    nothing is read until rows are indexed, and other tensors of the shard are not kept
    mapped with it (a view of safe_open's map would keep the whole shard)."""
    start = h.offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
    try:
        with open(root / h.file, "rb") as f:
            mm = mmap.mmap(f.fileno(), h.offset + h.nbytes - start, access=mmap.ACCESS_COPY,
                           offset=start)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {root}",
                              [f"corrupt shard: {h.file}: cannot map {h.name}: {e}"]) from None
    t = torch.frombuffer(mm, dtype=torch.uint8, offset=h.offset - start, count=h.nbytes)
    return t.view(_MAPPED_DTYPES[h.dtype]).view(h.shape)


def read_raw(info: CheckpointInfo, s: TensorSpec, reader: _ShardReader) -> dict:
    """One tensor's stored entries by role (weight / scale / plain), validated; an Engram
    table's memory-mapped (map_entry), the others through the shard reader."""
    def get(h):
        return map_entry(info.root, h) if s.fmt == ENGRAM_TABLE else reader.get(h)
    raw = {e.role: get(info.tensors[e.name]) for e in disk_entries(s, info.cfg.weight_block_size)}
    validate_raw(info, s, raw)
    return raw


def validate_raw(info: CheckpointInfo, s: TensorSpec, raw: dict) -> None:
    """Data errors the headers cannot show, named: E8M0 NaN scale bytes, e4m3 NaN codes of
    FP8 weights (an Engram table's codes when their rows are gathered: EngramTable)."""
    if "scale" not in raw:
        return
    if bool((raw["scale"].view(torch.uint8) == 255).any()):
        _bad(info, s.name[: -len(".weight")] + ".scale", "scale contains the E8M0 NaN byte 255")
    if s.fmt == FP8_32 and Q.has_e4m3_nan(raw["weight"]):
        _bad(info, s.name, "weight contains e4m3 NaN codes (0x7F/0xFF)")


def decode_raw(info: CheckpointInfo, s: TensorSpec, raw: dict, device):
    """One tensor's entries in the in-memory form: FP8_32 / FP4 dequantised to bf16 (exact),
    Engram tables kept as codes + scales on the host, as given (whatever `device`: only
    gathered rows move), bf16 / f32 as stored."""
    if "scale" in raw:
        sc, w = raw["scale"], raw["weight"]
        if s.fmt == ENGRAM_TABLE:
            return EngramTable(w, sc, f"{s.name} in {info.tensors[s.name].file}")
        if s.fmt == FP8_32:
            return Q.dequant_fp8_bf16(w, sc, info.cfg.weight_block_size, device)
        return Q.dequant_fp4_bf16(w, sc, 32, device)
    t = raw["plain"]
    want = {BF16: torch.bfloat16, F32: torch.float32}[s.fmt]
    return t.to(device, dtype=want, copy=True)


def _load(info: CheckpointInfo, specs, device, strip: str = "", chunk_bytes: int = 64 << 20) -> dict:
    """Specs' tensors in the in-memory form (Engram tables memory-mapped on the host)."""
    reader = _ShardReader(info.root, chunk_bytes)
    out = {}
    try:
        for s in specs:
            out[s.name[len(strip):]] = decode_raw(info, s, read_raw(info, s, reader), device)
    finally:
        reader.close()
    return out


class StreamingWeights(LayerStream):
    """WeightSource over a V4.1 checkpoint: globals loaded once, one layer at a time (asking
    for layer j drops layer i first), as V4's StreamingWeights. `loads` counts layer loads."""

    scan = staticmethod(scan_checkpoint)

    def load(self, specs, strip: str = "") -> dict:
        return _load(self.info, specs, self.device, strip)


def load_checkpoint(path, device="cpu", cfg: V41Config | None = None) -> V41Weights:
    """Every backbone tensor of a V4.1 checkpoint, validated first, in one V41Weights."""
    info = path if isinstance(path, CheckpointInfo) else scan_checkpoint(path, cfg)
    device = torch.device(device)
    tensors = _load(info, global_specs(info.cfg), device)
    for i in range(info.cfg.n_layers):
        tensors.update(_load(info, layer_specs(info.cfg, i), device))
    w = V41Weights(info.cfg, tensors)
    w.notes = list(info.notes)
    return w


__all__ = ["StreamingWeights", "decode_raw", "is_v41_checkpoint", "load_checkpoint", "map_entry",
           "quant_problems", "read_raw", "scan_checkpoint", "validate_raw"]
