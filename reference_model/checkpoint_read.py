"""Read a DeepSeek-native safetensors checkpoint (docs/research/dsv4-architecture.md §3): validate it from the shard
headers alone, then hand out weights in the in-memory representation of weights.py (FP8 /
FP4 dequantised to bf16 [out,in], bf16 / f32 as stored, tid2eid int64).

`StreamingWeights` keeps the globals and ONE layer resident, opening shards through
memory-mapped `safe_open` handles that are dropped after at most `io_chunk_bytes` of raw
data, so a 160 GB checkpoint runs a full forward in about one dequantised layer of RAM."""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import torch

from . import quant as Q
from .checkpoint_format import (FLOAT_DTYPES, CheckpointError, detect_layout, disk_entries,
                                expected_entries, is_skipped, is_transformers_naming, native_name,
                                natural_key, scale_name)
from .checkpoint_shards import (CheckpointInfo, LayerStream, _check_index, _find_config,  # noqa: F401
                                _read_headers, _shard_files, _ShardReader)
from .config import ConfigError, ModelConfig
from .specs import BF16, F32, FP4, FP8, I64, TensorSpec
from .weights import InMemoryWeights

log = logging.getLogger(__name__)
_PLAIN_FLOATS = ("BF16", "F32")           # plain float specs' dtypes (norms, mHC, sinks, ...)
_DECODE_CHUNK = 1 << 22          # elements per dequantisation step (bounds fp32 temporaries)
# output elements per decode_fp8/decode_fp4 step: its int16 scratch (FP8) or int32 index
# (FP4; plus an int64 copy with several threads) is 4 (+8) MB, cache-resident between
# passes, and steps are large enough to amortise per-op overhead
_FAST_DECODE_CHUNK = 1 << 21


def _trim_heap():
    """Give freed decode temporaries back to the OS. glibc's dynamic mmap threshold puts
    multi-MB temporaries on the heap, where holes between the resident bf16 tensors are not
    returned; without this a streamed layer costs ~1.7x its size in RSS."""


try:
    import ctypes
    _libc = ctypes.CDLL("libc.so.6")
    _libc.malloc_trim.argtypes = [ctypes.c_size_t]

    def _trim_heap():  # noqa: F811
        _libc.malloc_trim(0)
except (OSError, AttributeError):      # not glibc: nothing to do
    pass


# ---- checkpoint scan + validation -------------------------------------------------------
def _quant_problems(raw: dict) -> list[str]:
    """The checkpoint must be FP8 e4m3 with ue8m0 128×128 block scales and FP4 experts."""
    errs = []
    if "hidden_size" in raw or "num_hidden_layers" in raw:
        qc = raw.get("quantization_config")
        if qc is not None and not isinstance(qc, dict):
            errs.append(f"config: quantization_config is not an object: {qc!r}")
        elif qc is not None:
            want = {"fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
            for k, v in want.items():
                got = qc.get(k, v)
                if (list(got) if isinstance(got, (list, tuple)) else got) != v:
                    errs.append(f"config: quantization_config.{k} is {got!r}; only {v!r} is supported")
    else:
        for k, v in {"dtype": "fp8", "scale_fmt": "ue8m0"}.items():
            if raw.get(k, v) != v:
                errs.append(f"config: {k} is {raw[k]!r}; only {v!r} is supported")
    if raw.get("expert_dtype", "fp4") != "fp4":
        errs.append(f"config: expert_dtype is {raw['expert_dtype']!r}; only 'fp4' is supported")
    return errs


def _config(root: Path, cfg, problems: list[str], notes: list[str], parse=None, quant=None):
    """The checkpoint's config (or the given one, checked against the file's). `parse` /
    `quant`: the version's config reader and quantisation check (default V4's; V4.1's
    reader passes its own)."""
    parse = parse or ModelConfig.from_dict
    quant = quant or _quant_problems
    path = _find_config(root)
    if path is None:
        if cfg is None:
            raise CheckpointError(str(root), ["no config.json (or inference/config.json) and "
                                              "no config given"])
        notes.append("no config.json in the checkpoint; using the given config")
        return cfg, None
    rel = path.relative_to(root)
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise ConfigError("not a JSON object")
        file_cfg = parse(raw, name=root.name or "custom")
    except (ValueError, TypeError, KeyError, AttributeError) as e:    # ConfigError is a ValueError
        msg = f"config: {rel} is invalid: {e}"
        if cfg is None:
            raise CheckpointError(str(root), [msg]) from None
        problems.append(msg)
        return cfg, path
    problems += quant(raw)
    if cfg is None:
        return file_cfg, path
    a, b = file_cfg.to_dict(), cfg.to_dict()
    for k in a:
        if k != "name" and a[k] != b[k]:
            problems.append(f"config mismatch: {k}: {rel} has {a[k]!r}, given config has {b[k]!r}")
    return cfg, path


def _hints(cfg: ModelConfig, names: set[str]) -> list[str]:
    """Point at the config field when the tensors imply a different model size."""
    out = []
    from .v41.checkpoint_format import v41_signatures       # a V4.1 checkpoint under a V4 config
    v41 = v41_signatures(names) if getattr(cfg, "version", "v4") == "v4" else []
    if len(v41) >= 2:                                        # one stray name is just unexpected
        out.append(f"config says DeepSeek-V4 but tensors are DeepSeek-V4.1's ({', '.join(v41)}): "
                   "a V4.1 checkpoint mislabelled as V4? (reference_model.v41 reads V4.1)")
    layers = {int(n.split(".")[1]) for n in names if n.startswith("layers.") and n.split(".")[1].isdigit()}
    if layers and max(layers) + 1 != cfg.n_layers:
        out.append(f"config mismatch: checkpoint has layers 0..{max(layers)} "
                   f"({max(layers) + 1} layers), config n_layers={cfg.n_layers}")
    experts = {int(n.split(".")[4]) for n in names
               if ".ffn.experts." in n and n.split(".")[4].isdigit()}
    if experts and max(experts) + 1 != cfg.n_routed_experts:
        out.append(f"config mismatch: checkpoint has experts 0..{max(experts)}, "
                   f"config n_routed_experts={cfg.n_routed_experts}")
    return out


def _fmt_entry(e) -> str:
    return f"{e.dtype} {list(e.shape)}"


def scan_checkpoint(path, cfg: ModelConfig | None = None, strict: bool = True) -> CheckpointInfo:
    """Read config + every shard header and check them against the tensor table of the
    config. strict: raise one CheckpointError listing every problem; otherwise the problems
    are returned in `info.problems` (for `fidelity inspect`)."""
    root = Path(path)
    if root.is_file():                      # a single .safetensors file
        root = root.parent
    if not root.is_dir():
        raise CheckpointError(str(root), ["checkpoint directory does not exist"])
    problems: list[str] = []
    notes: list[str] = []
    cfg, config_file = _config(root, cfg, problems, notes)
    wm, files, total = _shard_files(root, problems)

    headers, bad_files = _read_headers(root, files, wm, problems)
    if wm is not None:
        _check_index(wm, headers, bad_files, total, problems, notes)

    naming = "transformers" if is_transformers_naming(headers) else "native"
    if naming == "transformers":          # key by native name; each header keeps its file name
        headers = {native_name(n): h for n, h in headers.items()}
        notes.append("tensor names: transformers' save_pretrained naming, mapped to DeepSeek's")
    skipped = {n: h for n, h in headers.items() if is_skipped(n)}
    main = {n: h for n, h in headers.items() if not is_skipped(n)}
    if skipped:
        stages = sorted({".".join(n.split(".")[:2]) for n in skipped}, key=natural_key)
        notes.append(f"skipped {len(skipped)} MTP/DSpark tensors ({', '.join(stages)}): "
                     "not part of the main-model forward")
    lost = {n for n, f in (wm or {}).items() if f in bad_files}   # covered by the shard problem
    layout, float_dtype, want = _check_tensors(cfg, main, lost, problems, notes)
    if set(main) != set(want):
        problems += _hints(cfg, set(main) - lost)
    info = CheckpointInfo(root, cfg, config_file, main, skipped, files, total, notes, problems,
                          layout=layout, float_dtype=float_dtype, naming=naming)
    for n in notes:
        log.info("%s: %s", root, n)
    if strict and problems:
        raise CheckpointError(f"checkpoint {root}", problems)
    return info


# ---- decoding ---------------------------------------------------------------------------


def decode_fp8(w: torch.Tensor, scale: torch.Tensor, device=None) -> torch.Tensor:
    """F8_E4M3 [out,in] + E8M0 [ceil(out/128), ceil(in/128)] -> bf16 (exact), in row chunks
    of ~`_FAST_DECODE_CHUNK` elements (`quant.dequant_fp8_bf16`: int16 bit construction,
    one bf16 multiply by the block scales through broadcast views, no fp32 temporaries)."""
    return Q.dequant_fp8_bf16(w, scale, 128, device or w.device, _FAST_DECODE_CHUNK)


def decode_fp4(packed: torch.Tensor, scale: torch.Tensor, device=None) -> torch.Tensor:
    """I8 [out,in/2] (low nibble = element 2j) + E8M0 [out, ceil(in/32)] -> bf16 (exact),
    in row chunks (`quant.dequant_fp4_bf16`: one gather per packed byte from a table of bf16
    pairs per scale byte)."""
    return Q.dequant_fp4_bf16(packed, scale, 32, device or packed.device, _FAST_DECODE_CHUNK)


def validate_raw(info: CheckpointInfo, s: TensorSpec, raw: dict) -> None:
    """Data errors the headers cannot show: E8M0 NaN scale bytes, e4m3 NaN weight codes,
    NVFP4 scales that are not finite and positive, expert ids out of range
    (CheckpointError naming the tensor and its shard)."""
    def bad(name, why):
        raise CheckpointError(f"checkpoint {info.root}",
                              [f"bad data: {name} in {info.tensors[name].file}: {why}"])
    if "scale" in raw:
        if bool((raw["scale"].view(torch.uint8) == 255).any()):
            bad(scale_name(s.name), "scale contains the E8M0 NaN byte 255")
        if s.fmt == FP8 and Q.has_e4m3_nan(raw["weight"]):
            bad(s.name, "weight contains e4m3 NaN codes (0x7F/0xFF)")
    elif "weight_scale" in raw:
        base = s.name[: -len(".weight")]
        ws = raw["weight_scale"].float()
        if not bool(torch.isfinite(ws).all()) or bool((ws < 0).any()):
            bad(base + ".weight_scale", "NVFP4 block scales must be finite and non-negative")
        s2 = float(raw["weight_scale_2"])
        if not (s2 > 0 and s2 < float("inf")):
            bad(base + ".weight_scale_2", f"NVFP4 global scale must be finite and positive, got {s2}")
    elif s.fmt == I64 and raw["plain"].numel():
        t = raw["plain"]
        if int(t.min()) < 0 or int(t.max()) >= info.cfg.n_routed_experts:
            bad(s.name, f"expert ids outside [0, {info.cfg.n_routed_experts})")


def decode_raw(s: TensorSpec, raw: dict, device) -> torch.Tensor:
    """One logical tensor from its stored entries, in the in-memory form (weights.py):
    FP8 / FP4 dequantised to bf16 (exact); NVFP4 experts to fp32 (e2m1 x e4m3 x fp32 global
    scale, as ModelOpt defines it); dense conversions and plain tensors in the spec's
    dtype (bf16 for quantisable tensors)."""
    if "scale" in raw:
        return (decode_fp8 if s.fmt == FP8 else decode_fp4)(raw["weight"], raw["scale"], device)
    if "weight_scale" in raw:
        return Q.dequant_nvfp4(raw["weight"].to(device), raw["weight_scale"].to(device),
                               raw["weight_scale_2"].to(device))
    t = raw["plain"]
    want = {FP8: torch.bfloat16, FP4: torch.bfloat16, BF16: torch.bfloat16, F32: torch.float32}.get(s.fmt)
    return t.to(device, dtype=want, copy=True) if want is not None else t.to(device, copy=True)


def _load_specs(info: CheckpointInfo, specs: list[TensorSpec], device, chunk_bytes: int,
                strip: str = "") -> dict[str, torch.Tensor]:
    reader = _ShardReader(info.root, chunk_bytes)
    out = {}
    try:
        for s in specs:
            raw = {e.role: reader.get(info.tensors[e.name])
                   for e in disk_entries(s, info.layout, info.float_dtype)}
            validate_raw(info, s, raw)
            t = decode_raw(s, raw, device)
            del raw
            if t.numel() >= _DECODE_CHUNK // 4:
                _trim_heap()
            out[s.name[len(strip):]] = t
    finally:
        reader.close()
    return out


# ---- public API -------------------------------------------------------------------------
class StreamingWeights(LayerStream):
    """WeightSource over a checkpoint directory: globals loaded once, layers one at a time
    (asking for layer j drops layer i first). `loads` counts layer loads (for tests)."""

    def __init__(self, path, device="cpu", cfg: ModelConfig | None = None,
                 io_chunk_bytes: int = 64 << 20):
        self.io_chunk_bytes = io_chunk_bytes
        super().__init__(path, device, cfg)

    scan = staticmethod(scan_checkpoint)

    def load(self, specs, strip: str = "") -> dict:
        return _load_specs(self.info, specs, self.device, self.io_chunk_bytes, strip)


def load_checkpoint(path, device="cpu", cfg: ModelConfig | None = None) -> InMemoryWeights:
    """Every main-model tensor of a checkpoint, dequantised, in one InMemoryWeights."""
    src = StreamingWeights(path, device, cfg)
    tensors = dict(src.global_weights())
    for i in range(src.cfg.n_layers):
        tensors.update({f"layers.{i}.{k}": v for k, v in src.layer_weights(i).items()})
        src.release()
    w = InMemoryWeights(src.cfg, tensors)
    w.notes = list(src.info.notes)
    return w


def _check_tensors(cfg: ModelConfig, main: dict, lost: set[str], problems: list[str],
                   notes: list[str]) -> tuple[str, str | None, dict]:
    """The main model's tensors against the config's table for the detected layout:
    missing, unexpected, wrong dtype or shape. Returns (layout, float dtype, the table)."""
    layout, float_dtype, mixed = detect_layout(cfg, main)
    problems += mixed
    want = expected_entries(cfg, layout, float_dtype)
    if layout == "native-dense":           # any float dtype per tensor: bf16, fp16 or fp32
        want = {n: (replace(e, dtype=main[n].dtype) if n in main and e.dtype in FLOAT_DTYPES + _PLAIN_FLOATS
                    and main[n].dtype in FLOAT_DTYPES else e) for n, e in want.items()}
    if layout != "native":
        notes.append(f"layout {layout}" + (f" ({float_dtype})" if float_dtype else ""))
    for name in sorted(set(want) - set(main) - lost, key=natural_key):
        problems.append(f"missing tensor: {name} ({_fmt_entry(want[name])})")
    for name in sorted(set(main) - set(want), key=natural_key):
        problems.append(f"unexpected tensor: {name} ({_fmt_entry(main[name])}) in {main[name].file}")
    differ = [n for n in set(main) & set(want)
              if main[n].dtype != want[n].dtype or tuple(main[n].shape) != tuple(want[n].shape)]
    for name in sorted(differ, key=natural_key):
        h, e = main[name], want[name]
        if h.dtype != e.dtype:
            problems.append(f"wrong dtype: {name}: expected {e.dtype}, found {h.dtype} in {h.file}")
        if tuple(h.shape) != tuple(e.shape):
            problems.append(f"wrong shape: {name}: expected {list(e.shape)}, found {list(h.shape)} in {h.file}")
    return layout, float_dtype, want
