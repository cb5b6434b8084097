"""The checkpoint mlx-vlm is given. `native`: the folder as DeepSeek ships it (mlx-vlm's loader
reads DeepSeek's names, FP8 blocks and FP4 experts itself). `f32`: a copy with every FP8 / FP4
weight dequantised by our decoder (exact) and every float tensor stored as float32, the
quantization_config dropped -- mlx-vlm then runs dense float32 arithmetic, which separates its
algorithm from its low-precision kernels (and is the route on a CPU where its quantized or
bf16 kernels are missing). Written once per source, shard by shard, cached by what it was
made from."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from reference_model.checkpoint_read import decode_fp4, decode_fp8

from fidelity.llamacpp.paths import cache_root

WEIGHTS = ("native", "f32")
HISA_DEFAULTS = {"index_block": 64, "index_keep": 16}    # mlx-vlm's ModelConfig, when a config omits them


def model_dir(src: Path, weights: str) -> Path:
    """The folder mlx-vlm loads for `src` under `weights` (the f32 copy made when missing or stale)."""
    src = Path(src).resolve()
    if weights == "native":
        return src
    if weights != "f32":
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    out = cache_root() / "mlx-vlm-models" / f"{src.name}-f32"
    stamp = out / "SOURCE"
    if not (stamp.is_file() and stamp.read_text() == _identity(src)):
        f32_copy(src, out)
        stamp.write_text(_identity(src))
    return out


def _identity(src: Path) -> str:
    """What the copy was made from: the source's path and its files' sizes and times."""
    files = sorted(p for p in src.iterdir() if p.is_file())
    return json.dumps([str(src)] + [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files])


def f32_copy(src: Path, out: Path) -> None:
    """`src`'s main shards dequantised to float32 under DeepSeek's own names (the `.scale`
    companions consumed), its config without quantization_config, its tokenizer."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    index = {}
    for shard in sorted(src.glob("model-*.safetensors")):
        tensors = _dequantised(shard)
        save_file(tensors, str(tmp / shard.name))
        index.update({k: shard.name for k in tensors})
    if not index:
        raise FileNotFoundError(f"{src} holds no model-*.safetensors shards")
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg.pop("expert_dtype", None)
    cfg["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def _dequantised(shard: Path) -> dict[str, torch.Tensor]:
    out = {}
    with safe_open(str(shard), "pt") as f:
        keys = set(f.keys())
        for k in sorted(keys):
            if k.endswith(".scale") and k[: -len(".scale")] + ".weight" in keys:
                continue
            t = f.get_tensor(k)
            scale = k[: -len(".weight")] + ".scale" if k.endswith(".weight") else None
            if scale in keys:
                decode = decode_fp8 if t.dtype == torch.float8_e4m3fn else decode_fp4
                t = decode(t, f.get_tensor(scale))
            out[k] = t.float() if t.is_floating_point() else t
    return out


def hisa_setting(model_dir, index_block: int | None = None) -> dict:
    """How mlx-vlm will run HISA on a checkpoint folder: its config's index_block and index_keep,
    mlx-vlm's defaults where the config is silent, `index_block` overriding (0: off)."""
    cfg = dict(HISA_DEFAULTS)
    if model_dir and (Path(model_dir) / "config.json").is_file():
        cfg.update(json.loads((Path(model_dir) / "config.json").read_text()))
    return {"index_block": cfg["index_block"] if index_block is None else index_block,
            "index_keep": cfg["index_keep"]}


def hisa_toggle(setting: dict) -> str:
    """The golden's hisa toggle spelled for a HISA setting ('' when it is off)."""
    block, keep = setting.get("index_block") or 0, setting.get("index_keep") or 0
    return f"hisa(block={block},keep={keep})" if block > 0 and keep > 0 else ""
