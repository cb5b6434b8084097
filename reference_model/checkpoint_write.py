"""Write any model (any config, incl. `tiny`) as a sharded DeepSeek-native checkpoint:
FP8 e4m3 + 128×128 E8M0 scales, FP4 e2m1 packed two per byte (low nibble first) + 1×32
E8M0 scales, bf16 / f32 / i64 as is, `model-0000X-of-0000N.safetensors` shards, an index
with metadata.total_size and an HF-keyed config.json.

Scales are the SMALLEST power of two that holds the block (amax/s <= 448 resp. 6), so a
tensor already on the grid is written bit-exactly: its own scale is >= that minimum, and
multiplying e4m3 / e2m1 codes up by 2^j while they stay in range is exact (dividing down,
as an amax·(1/448) rule can do at the 1e-4 floor or at amax = 448·2^k, loses subnormals).

The writer is layer-wise (`write_globals`, `write_layer(i, ...)`), holds at most one shard
of encoded bytes, and builds everything in a temp dir renamed into place at the end."""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from . import quant as Q
from .checkpoint_format import (FP4_BLOCK, FP8_BLOCK, INDEX_NAME, CheckpointError,
                                disk_entries, natural_key)
from .config import _KEYS, ModelConfig
from .specs import BF16, F32, FP4, FP8, I64, TensorSpec, global_specs, layer_specs

_ENCODE_ROWS_ELEMS = 1 << 22


# ---- config -----------------------------------------------------------------------------
def hf_config_dict(cfg: ModelConfig) -> dict:
    """config.json in HF keys, as DeepSeek ships it (ModelConfig.from_file reads it back to
    an equal config)."""
    d = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
    for ours, (hf, _) in _KEYS.items():
        d[hf] = getattr(cfg, ours)
    d.update({
        "compress_ratios": list(cfg.compress_ratios) + [0] * cfg.n_mtp_layers,
        "num_key_value_heads": 1,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_scaling": {"type": "yarn", "factor": cfg.rope_factor,
                         "original_max_position_embeddings": cfg.original_seq_len,
                         "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow},
        "hidden_act": "silu", "tie_word_embeddings": False, "topk_method": "noaux_tc",
        "norm_topk_prob": True, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "scale_fmt": "ue8m0", "weight_block_size": [FP8_BLOCK, FP8_BLOCK]},
        "expert_dtype": "fp4",
    })
    return d


# ---- encoding ---------------------------------------------------------------------------
def _min_pow2_exp(amax: torch.Tensor, mant: float, exp: int) -> torch.Tensor:
    """Smallest k with amax <= (mant·2^exp)·2^k, exactly (frexp: amax = m·2^e, m in [.5,1));
    zero blocks get k = 0; clamped to the E8M0 range."""
    m, e = torch.frexp(amax)
    k = torch.where(m <= mant, e - exp, e - exp + 1)
    k = torch.where(amax == 0, torch.zeros_like(k), k)
    return k.clamp(-127, 127)


def _e8m0(k: torch.Tensor) -> torch.Tensor:
    return (k + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def encode_fp8(w: torch.Tensor, block: int = FP8_BLOCK):
    """[out,in] float -> (F8_E4M3 [out,in], F8_E8M0 [ceil(out/b), ceil(in/b)])."""
    out, inp = w.shape
    wf = w.float()
    wp = F.pad(wf, (0, -inp % block, 0, -out % block))
    amax = wp.unflatten(0, (-1, block)).unflatten(2, (-1, block)).abs().amax(dim=(1, 3))
    k = _min_pow2_exp(amax, 0.875, 9)                      # 448 = 0.875·2^9
    s = torch.ldexp(torch.ones_like(amax), k)
    se = s.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]
    q = (wf / se).clamp(-Q.FP8_MAX, Q.FP8_MAX).to(torch.float8_e4m3fn)
    return q, _e8m0(k)


# |v|·2 for e2m1 magnitudes 0 .5 1 1.5 2 3 4 6 -> code 0..7 (255 = off grid)
_E2M1_CODE = torch.tensor([0, 1, 2, 3, 4, 255, 5, 255, 6, 255, 255, 255, 7], dtype=torch.uint8)


def _pack_e2m1(v: torch.Tensor) -> torch.Tensor | None:
    """Grid values [out,in] -> I8 [out,in/2], element 2j in the low nibble; None if some
    value is off the e2m1 grid. A table lookup (quant.pack_fp4 searches the grid, which is
    too slow for GB-sized checkpoints)."""
    a2 = v.abs() * 2
    i = a2.to(torch.int32)
    if bool(((i.float() != a2) | (i > 12)).any()):          # also catches NaN
        return None
    mag = _E2M1_CODE.to(v.device)[i]
    if bool((mag == 255).any()):
        return None
    codes = (mag | (torch.signbit(v).to(torch.uint8) << 3)).unflatten(-1, (-1, 2))
    return (codes[..., 0] | (codes[..., 1] << 4)).view(torch.int8)


def encode_fp4(w: torch.Tensor, block: int = FP4_BLOCK):
    """[out,in] float -> (I8 packed [out,in/2], F8_E8M0 [out, ceil(in/32)]); values off the
    grid are rounded to nearest e2m1 (ties to even)."""
    out, inp = w.shape
    packed = torch.empty(out, inp // 2, dtype=torch.int8, device=w.device)
    scales = torch.empty(out, -(-inp // block), dtype=torch.float8_e8m0fnu, device=w.device)
    rows = max(1, _ENCODE_ROWS_ELEMS // max(inp, 1))
    for a in range(0, out, rows):
        wf = w[a:a + rows].float()
        wp = F.pad(wf, (0, -inp % block))
        amax = wp.unflatten(-1, (-1, block)).abs().amax(-1)
        k = _min_pow2_exp(amax, 0.75, 3)                    # 6 = 0.75·2^3
        se = torch.ldexp(torch.ones_like(amax), k).repeat_interleave(block, -1)[:, :inp]
        v = (wf / se).clamp(-Q.FP4_MAX, Q.FP4_MAX)
        p = _pack_e2m1(v)                                   # fast path: already on the grid
        packed[a:a + rows] = p if p is not None else _pack_e2m1(Q.round_to_e2m1(v))
        scales[a:a + rows] = _e8m0(k)
    return packed, scales


def encode(spec: TensorSpec, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """In-memory tensor -> its safetensors entries (CPU, contiguous)."""
    t = t.detach().to("cpu")
    if spec.fmt in (FP8, FP4):
        q, s = (encode_fp8 if spec.fmt == FP8 else encode_fp4)(t)
        w_e, s_e = disk_entries(spec)
        return {w_e.name: q.contiguous(), s_e.name: s.contiguous()}
    dt = {BF16: torch.bfloat16, F32: torch.float32, I64: torch.int64}[spec.fmt]
    return {spec.name: t.to(dt).contiguous()}


def _input_problems(spec: TensorSpec, t) -> list[str]:
    if not isinstance(t, torch.Tensor):
        return [f"not a tensor: {spec.name} ({type(t).__name__})"]
    errs = []
    if tuple(t.shape) != tuple(spec.shape):
        errs.append(f"wrong shape: {spec.name}: expected {list(spec.shape)}, got {list(t.shape)}")
    if spec.fmt == I64 and (t.is_floating_point() or t.is_complex()):
        errs.append(f"wrong dtype: {spec.name}: expected integer expert ids, got {t.dtype}")
    if spec.fmt != I64 and not t.is_floating_point():
        errs.append(f"wrong dtype: {spec.name}: expected a floating tensor, got {t.dtype}")
    return errs


# ---- writer -----------------------------------------------------------------------------
class CheckpointWriter:
    """Layer-wise writer. Use as a context manager (or call close()); on error nothing is
    left at `out_dir`. Tensor problems are collected and raised together at close()."""

    def __init__(self, out_dir, cfg: ModelConfig, max_shard_bytes: int = 4 << 30,
                 overwrite: bool = False):
        self.out = Path(out_dir)
        if self.out.exists() and not overwrite:
            raise FileExistsError(f"{self.out} exists (pass overwrite=True to replace it)")
        if max_shard_bytes <= 0:
            raise ValueError("max_shard_bytes must be positive")
        self.cfg, self.max_shard = cfg, max_shard_bytes
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        self.tmp.chmod(0o755)            # mkdtemp makes 0700; results are meant to be shared
        self.overwrite = overwrite
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._parts: list[list[str]] = []           # tensor names per written shard
        self._sizes: dict[str, int] = {}
        self._done: set[str] = set()                 # "globals", "layer i"
        self.problems: list[str] = []
        self.closed = False

    # -- per-version hooks (reference_model/v41/checkpoint_write.py overrides them) --
    def _specs(self, i: int | None = None) -> list[TensorSpec]:
        """The globals' specs (i None) or layer i's."""
        return global_specs(self.cfg) if i is None else layer_specs(self.cfg, i)

    def _input_problems(self, spec: TensorSpec, t) -> list[str]:
        return _input_problems(spec, t)

    def _encode(self, spec: TensorSpec, t) -> dict[str, torch.Tensor]:
        return encode(spec, t)

    def _config_dict(self) -> dict:
        return hf_config_dict(self.cfg)

    # -- input --
    def write_globals(self, tensors: dict[str, torch.Tensor]):
        self._write("globals", self._specs(), tensors, "")

    def write_layer(self, i: int, tensors: dict[str, torch.Tensor]):
        """`tensors` keyed like WeightSource.layer_weights (no `layers.{i}.` prefix)."""
        if not 0 <= i < self.cfg.n_layers:
            self.problems.append(f"layer {i} out of range 0..{self.cfg.n_layers - 1}")
            return
        self._write(f"layer {i}", self._specs(i), tensors, f"layers.{i}.")

    def _write(self, what, specs, tensors, prefix):
        if what in self._done:
            self.problems.append(f"{what} written twice")
            return
        self._done.add(what)
        names = {s.name[len(prefix):] for s in specs}
        for k in sorted(set(tensors) - names, key=natural_key):
            self.problems.append(f"unexpected tensor: {prefix}{k}")
        for s in specs:
            k = s.name[len(prefix):]
            if k not in tensors:
                self.problems.append(f"missing tensor: {s.name}")
                continue
            errs = self._input_problems(s, tensors[k])
            if errs:
                self.problems += errs
                continue
            if not self.problems:          # after the first problem only validate
                self._add(self._encode(s, tensors[k]))

    def _add(self, entries: dict[str, torch.Tensor]):
        nbytes = sum(t.numel() * t.element_size() for t in entries.values())
        if self._buf and self._buf_bytes + nbytes > self.max_shard:
            self._flush()
        self._buf.update(entries)
        self._buf_bytes += nbytes
        for k, t in entries.items():
            self._sizes[k] = t.numel() * t.element_size()

    def _flush(self):
        if not self._buf:
            return
        k = len(self._parts)
        save_file(self._buf, str(self.tmp / f"part-{k:05d}.safetensors"), metadata={"format": "pt"})
        self._parts.append(list(self._buf))
        self._buf, self._buf_bytes = {}, 0

    # -- finish --
    def close(self) -> Path:
        if self.closed:
            return self.out
        try:
            want = {"globals"} | {f"layer {i}" for i in range(self.cfg.n_layers)}
            for w in sorted(want - self._done, key=natural_key):
                self.problems.append(f"{w} was never written")
            if self.problems:
                raise CheckpointError(f"writing {self.out}", self.problems)
            self._flush()
            n = len(self._parts)
            weight_map = {}
            for k, names in enumerate(self._parts):
                fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
                os.replace(self.tmp / f"part-{k:05d}.safetensors", self.tmp / fname)
                weight_map.update({name: fname for name in names})
            index = {"metadata": {"total_size": sum(self._sizes.values())},
                     "weight_map": dict(sorted(weight_map.items(), key=lambda kv: natural_key(kv[0])))}
            (self.tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
            (self.tmp / "config.json").write_text(json.dumps(self._config_dict(), indent=2) + "\n")
            self._publish()
        except BaseException:
            self.abort()
            raise
        self.closed = True
        return self.out

    def _publish(self):
        old = None
        if self.out.exists():
            if not self.overwrite:
                raise FileExistsError(f"{self.out} appeared while writing")
            old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}")
            os.replace(self.out, old)
        os.replace(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self):
        self._buf = {}
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
            return False
        self.close()
        return False


def _layer_of(name: str, n_layers: int) -> bool:
    """Is `name` under `layers.{i}.` for a valid i (then write_layer judges it)?"""
    m = re.match(r"layers\.(\d+)\.", name)
    return bool(m) and int(m[1]) < n_layers


def save_checkpoint(weights, out_dir, max_shard_bytes: int = 4 << 30, overwrite: bool = False,
                    progress=None) -> Path:
    """Write any WeightSource (InMemoryWeights or a lazy per-layer source) as a DeepSeek-
    native checkpoint, one layer at a time. `progress(i, n)` is called after each layer."""
    cfg = weights.cfg
    w = CheckpointWriter(out_dir, cfg, max_shard_bytes, overwrite)
    try:
        extra = set(getattr(weights, "tensors", {})) - {s.name for s in global_specs(cfg)}
        extra = {k for k in extra if not _layer_of(k, cfg.n_layers)}
        w.problems += [f"unexpected tensor: {k}" for k in sorted(extra, key=natural_key)]
        w.write_globals(weights.global_weights())
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            if hasattr(weights, "tensors"):       # InMemoryWeights.layer_weights hides unknown names
                layer = {k[len(p):]: v for k, v in weights.tensors.items() if k.startswith(p)}
            else:
                layer = weights.layer_weights(i)
            w.write_layer(i, layer)
            del layer
            if progress:
                progress(i + 1, cfg.n_layers)
        return w.close()
    except BaseException:
        w.abort()
        raise
