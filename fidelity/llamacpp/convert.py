"""A DeepSeek-V4 checkpoint in DeepSeek's naming -> GGUF, through llama.cpp's own converter
(`convert_hf_to_gguf.py` of the pinned build), unmodified except for two declared choices:

* **Pre-tokenizer.** llama.cpp recognises a BPE pre-tokenizer by hashing the token ids of a
  fixed text; a tokenizer outside its table stops with "BPE pre-tokenizer was not recognized".
  Our embedded tokenizer's pre-tokenizer is individual digits then GPT-2's byte-level regex,
  which is exactly llama.cpp's `starcoder` pre-type (`\\p{N}` then the GPT-2 regex, applied in
  sequence). We read the tokenizer's JSON, check it is that, and declare it; any other
  pre-tokenizer is an error naming it. `/tokenize` parity is tested on real prompts.
* **FP8 weights.** llama.cpp's V4 converter dequantizes FP8 block weights and writes them as
  Q8_0 (32-wide int8 blocks with an fp16 scale), which is not lossless for e4m3 values.
  `fp8="q8_0"` keeps that (the GGUF a llama.cpp user gets); `fp8="f32"` writes the dequantized
  values exactly, so weight conversion and graph numerics can be told apart.

Routed experts (FP4 with E8M0 scales per 32) are repacked by the converter to MXFP4, which
holds them exactly."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from . import paths

FP8_CHOICES = ("q8_0", "f32")


class ConvertError(RuntimeError):
    pass


def declared_pre_tokenizer(tokenizer_json: Path) -> str:
    """The llama.cpp pre-type equal to the tokenizer's pre-tokenizer, or ConvertError naming
    what it is."""
    try:
        pre = json.loads(Path(tokenizer_json).read_text()).get("pre_tokenizer") or {}
    except (OSError, ValueError) as e:
        raise ConvertError(f"cannot read {tokenizer_json}: {e}") from None
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [(s.get("type"), s.get("individual_digits"), s.get("use_regex"), s.get("add_prefix_space"))
             for s in steps]
    if kinds == [("Digits", True, None, None), ("ByteLevel", None, True, False)]:
        return "starcoder"
    raise ConvertError(f"{tokenizer_json}: pre-tokenizer {json.dumps(pre)[:200]} has no declared "
                       "llama.cpp pre-type (known: individual Digits then ByteLevel with its regex "
                       "= starcoder)")


def convert(model_dir: Path, out: Path, fp8: str = "q8_0", log: Path | None = None,
            build: paths.Build | None = None) -> Path:
    """Run `build`'s converter (default the pinned build's) on `model_dir` into `out` (written
    to a temp name, then renamed). Returns `out`."""
    if fp8 not in FP8_CHOICES:
        raise ConvertError(f"fp8 must be one of {', '.join(FP8_CHOICES)}, got {fp8!r}")
    model_dir, out = Path(model_dir), Path(out)
    for need in ("config.json", "tokenizer.json"):
        if not (model_dir / need).is_file():
            raise ConvertError(f"{model_dir} has no {need}: not a checkpoint folder")
    pre = declared_pre_tokenizer(model_dir / "tokenizer.json")
    src = (build or paths.pinned()).source()
    tmp = out.with_name(f"{out.name}.{os.getpid()}.part")      # concurrent converters never share one
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "fidelity.llamacpp.convert", str(src), pre, fp8,
           str(model_dir), "--outfile", str(tmp), "--outtype", "f32" if fp8 == "f32" else "auto"]
    log = log or out.with_suffix(".convert.log")
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise ConvertError(f"llama.cpp's converter failed on {model_dir} (exit {rc}); "
                           f"log: {log}")
    tmp.replace(out)
    return out


def cached(model_dir: Path, fp8: str = "q8_0", build: paths.Build | None = None) -> Path:
    """The checkpoint's GGUF in the build folder's `gguf/` (by that build's own converter),
    converted once per (checkpoint files, fp8 choice, llama.cpp build): keyed by the files'
    names, sizes and times, so a changed checkpoint is converted again and a large one is not
    hashed."""
    build = build or paths.pinned()
    model_dir = Path(model_dir).resolve()
    files = sorted(p for p in model_dir.rglob("*") if p.is_file())
    key = hashlib.sha256(json.dumps([build.spec, fp8] + [
        [str(p.relative_to(model_dir)), p.stat().st_size, p.stat().st_mtime_ns] for p in files]).encode())
    out = build.source().parent / "gguf" / f"{model_dir.name}-{fp8}-{key.hexdigest()[:12]}.gguf"
    return out if out.is_file() else convert(model_dir, out, fp8, build=build)


def _run_converter(src: str, pre: str, fp8: str, argv: list[str]) -> None:
    """In the converter's own process: load llama.cpp's converter from `src`, declare the
    pre-tokenizer where its hash table has none, keep FP8 exact when asked, and run it."""
    sys.path[:0] = [src, str(Path(src) / "gguf-py")]
    import gguf
    from conversion import base, deepseek

    recognise = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return recognise(self, tokenizer)
        except NotImplementedError:
            print(f"dsv4-fidelity: pre-tokenizer declared as {pre!r} (checked from tokenizer.json)")
            return pre
    base.TextModel.get_vocab_base_pre = get_vocab_base_pre

    if fp8 == "f32":
        force = deepseek.DeepseekV4Model.tensor_force_quant

        def tensor_force_quant(self, name, new_name, bid, n_dims):
            if name in self._dsv4_fp8_dequantized:
                return gguf.GGMLQuantizationType.F32
            return force(self, name, new_name, bid, n_dims)
        deepseek.DeepseekV4Model.tensor_force_quant = tensor_force_quant

    sys.argv = ["convert_hf_to_gguf.py", *argv]
    import runpy
    runpy.run_path(str(Path(src) / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    _run_converter(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
