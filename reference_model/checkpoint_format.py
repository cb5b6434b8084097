"""On-disk layout of a DeepSeek-native checkpoint (docs/research/dsv4-architecture.md §3): which safetensors entries
each TensorSpec becomes, reading shard headers without touching tensor data, and the one
error type that lists every problem at once (so a bad 46-shard checkpoint is fixed in one
pass, not one error per run)."""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from .config import ModelConfig
from .specs import BF16, F32, FP4, FP8, I64, TensorSpec, all_specs

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
FP8_BLOCK = 128          # 128×128 weight blocks, one E8M0 scale each
FP4_BLOCK = 32           # 1×32 blocks along the input dim
SKIP_PREFIXES = ("mtp.",)   # MTP layer / DSpark drafter stages: not part of the main forward

# safetensors dtype string -> bytes per element
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
               "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
               "I64": 8, "U64": 8, "F64": 8}
_PLAIN = {BF16: "BF16", F32: "F32", I64: "I64"}


class CheckpointError(ValueError):
    """A checkpoint (or a model being written as one) is invalid; `problems` lists every
    offending tensor, shard or config field, one line each."""

    def __init__(self, where: str, problems: list[str]):
        self.where = where
        self.problems = list(problems)
        n = len(self.problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{where}: {n} problem{'s' if n != 1 else ''}:\n{lines}")


@dataclass(frozen=True)
class DiskEntry:
    """One safetensors entry a spec needs: its name, dtype string and on-disk shape."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    role: str            # "weight" (quantised payload), "scale" or "plain"

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def scale_name(weight_name: str) -> str:
    """`x.weight` -> `x.scale` (DeepSeek names scales `.scale`, not `weight_scale_inv`)."""
    assert weight_name.endswith(".weight"), weight_name
    return weight_name[: -len(".weight")] + ".scale"


# Layouts a checkpoint of DeepSeek-native names can have (docs/weight-formats.md):
#   native         FP8 / FP4 with E8M0 scales (DeepSeek's release)
#   native-dense   the quantised tensors stored dequantised in bf16 / fp16 / fp32, no scales
#   nvfp4-experts  NVIDIA ModelOpt NVFP4 routed experts (weight, weight_scale, weight_scale_2,
#                  input_scale), everything else as in `native`
LAYOUTS = ("native", "native-dense", "nvfp4-experts")
FLOAT_DTYPES = ("BF16", "F16", "F32")
NVFP4_BLOCK = 16
_ROUTED = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")


def is_routed_expert(name: str) -> bool:
    return bool(_ROUTED.match(name))


def disk_entries(spec: TensorSpec, layout: str = "native", float_dtype: str | None = None) -> list[DiskEntry]:
    """The entries of one logical tensor: FP8 = F8_E4M3 [out,in] + F8_E8M0 scale on the
    ceil(out/128)×ceil(in/128) grid; FP4 = I8 [out,in/2] (two e2m1 per byte) + F8_E8M0
    scale [out, ceil(in/32)]; bf16 / f32 / i64 stored as is. `native-dense`: quantised
    tensors as one `float_dtype` [out,in] entry; `nvfp4-experts`: routed experts as U8
    [out,in/2] + F8_E4M3 weight_scale [out, in/16] + F32 weight_scale_2 [] + F32 input_scale []."""
    if layout == "native-dense" and spec.fmt in (FP8, FP4):
        return [DiskEntry(spec.name, float_dtype or "BF16", tuple(spec.shape), "plain")]
    if layout == "nvfp4-experts" and spec.fmt == FP4 and is_routed_expert(spec.name):
        out, inp = spec.shape
        base = spec.name[: -len(".weight")]
        return [DiskEntry(spec.name, "U8", (out, inp // 2), "weight"),
                DiskEntry(base + ".weight_scale", "F8_E4M3", (out, _ceil(inp, NVFP4_BLOCK)), "weight_scale"),
                DiskEntry(base + ".weight_scale_2", "F32", (), "weight_scale_2"),
                DiskEntry(base + ".input_scale", "F32", (), "input_scale")]
    if spec.fmt == FP8:
        out, inp = spec.shape
        return [DiskEntry(spec.name, "F8_E4M3", (out, inp), "weight"),
                DiskEntry(scale_name(spec.name), "F8_E8M0",
                          (_ceil(out, FP8_BLOCK), _ceil(inp, FP8_BLOCK)), "scale")]
    if spec.fmt == FP4:
        out, inp = spec.shape
        if inp % 2:
            raise ValueError(f"{spec.name}: FP4 input dim {inp} must be even (two per byte)")
        return [DiskEntry(spec.name, "I8", (out, inp // 2), "weight"),
                DiskEntry(scale_name(spec.name), "F8_E8M0", (out, _ceil(inp, FP4_BLOCK)), "scale")]
    return [DiskEntry(spec.name, _PLAIN[spec.fmt], tuple(spec.shape), "plain")]


def expected_entries(cfg: ModelConfig, layout: str = "native",
                     float_dtype: str | None = None) -> dict[str, DiskEntry]:
    """Every safetensors entry of the main model for `cfg` (no tensor is allocated)."""
    out = {}
    for s in all_specs(cfg):
        for e in disk_entries(s, layout, float_dtype):
            out[e.name] = e
    return out


_HF_GLOBALS = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
               "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
               "model.hc_head.hc_scale": "hc_head_scale"}
_HF_KV_NORM = re.compile(r"^model\.layers\.(\d+)\.attn\.norm\.weight$")


def is_transformers_naming(names) -> bool:
    """Names as transformers' `save_pretrained` writes DeepseekV4 (docs/weight-formats.md
    §3.3): the native names under `model.`, except `head.weight`."""
    return any(n.startswith("model.layers.") for n in names)


def native_name(name: str) -> str:
    """The DeepSeek-native name of a tensor saved by transformers: `model.` dropped, the
    embedding / final norm / mHC head renamed, and the attention kv norm that transformers
    writes as `attn.norm.weight` (§3.3's quirk) back to `attn.kv_norm.weight`."""
    if name in _HF_GLOBALS:
        return _HF_GLOBALS[name]
    m = _HF_KV_NORM.match(name)
    if m:
        return f"layers.{m.group(1)}.attn.kv_norm.weight"
    return name[len("model."):] if name.startswith("model.") else name


def detect_layout(cfg: ModelConfig, headers: dict) -> tuple[str, str | None, list[str]]:
    """(layout, float dtype of a dense layout, problems) from the tensor names and dtypes:
    NVFP4 when routed experts carry `weight_scale_2`; dense when the quantised tensors are
    floats with no `.scale`; a checkpoint mixing them is one problem naming examples."""
    quant = [s for s in all_specs(cfg) if s.fmt in (FP8, FP4)]
    if any(n.endswith(".weight_scale_2") for n in headers):
        return "nvfp4-experts", None, []
    floats = [s.name for s in quant if s.name in headers and headers[s.name].dtype in FLOAT_DTYPES]
    packed = [s.name for s in quant if s.name in headers and headers[s.name].dtype not in FLOAT_DTYPES]
    if len(floats) <= len(packed):          # native; stray floats are listed as wrong dtypes
        return "native", None, []
    dense = sorted({headers[n].dtype for n in floats})
    if packed:
        return "native-dense", None, [
            f"mixed formats: {len(floats)} quantisable tensors are stored as floats (e.g. {floats[0]}) "
            f"but {len(packed)} are quantised (e.g. {packed[0]}); a checkpoint must be all one or "
            "the other (or NVFP4 experts with the rest native)"]
    return "native-dense", dense[0] if len(dense) == 1 else None, []


def natural_key(name: str):
    """Sort `layers.10` after `layers.9`."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def is_skipped(name: str) -> bool:
    return name.startswith(SKIP_PREFIXES)


# ---- shard headers ----------------------------------------------------------------------
@dataclass(frozen=True)
class TensorHeader:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str            # shard file name (relative to the checkpoint dir)
    nbytes: int
    offset: int = 0      # where its bytes start in the file (for memory-mapping one entry)


class ShardError(Exception):
    """Why a shard file is unreadable (message is completed with the file name)."""


def read_header(path: Path) -> tuple[dict[str, TensorHeader], dict]:
    """Parse a safetensors header without reading tensor data; checks that the file is
    exactly as long as the header says, so a truncated download is caught here."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ShardError(f"file is {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ShardError(f"header length {n} exceeds file size {size} (truncated or "
                                 "not a safetensors file)")
            raw = fh.read(n)
    except OSError as e:
        raise ShardError(f"cannot read: {e}") from None
    try:
        hdr = json.loads(raw)
        if not isinstance(hdr, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise ShardError(f"header is not valid JSON ({e})") from None
    meta = hdr.pop("__metadata__", None) or {}
    out, end = {}, 0
    for name, h in hdr.items():
        try:
            dtype, shape, (a, b) = h["dtype"], tuple(int(d) for d in h["shape"]), h["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ShardError(f"malformed header entry for {name!r}") from None
        if dtype not in DTYPE_BYTES:
            raise ShardError(f"unknown dtype {dtype!r} for {name}")
        numel = 1
        for d in shape:
            numel *= d
        if b - a != numel * DTYPE_BYTES[dtype] or a < 0:
            raise ShardError(f"data offsets of {name} ({a}..{b}) do not match its dtype/shape")
        end = max(end, b)
        out[name] = TensorHeader(name, dtype, shape, path.name, b - a, 8 + n + a)
    if size != 8 + n + end:
        what = "truncated" if size < 8 + n + end else "has trailing bytes"
        raise ShardError(f"{what}: header describes {8 + n + end} bytes, file has {size}")
    return out, meta
