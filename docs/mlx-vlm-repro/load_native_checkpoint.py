"""mlx-vlm 0.7.10, DeepSeek-V4: a checkpoint in DeepSeek's own layout (FP8 e4m3 weights with
`.scale` E8M0 blocks, FP4 experts packed in int8) does not load.

Its config says quant_method "fp8" with 128x128 blocks, so mlx_vlm.utils.load_model asks the
shared FP8 helper (mlx_vlm/fp8.py) first; that helper claims the whole model as MXFP8 (it finds
no `.weight_scale_inv` to convert, DeepSeek names them `.scale`) and DeepSeek-V4's own
make_quantization_config (MXFP4 experts) is never reached: the FP4 experts then have half the
width an MXFP8 layer expects. Lifting that one claim loads the checkpoint (fidelity's harness
does so). Run with mlx-vlm's own venv on any such checkpoint folder, e.g. this repository's:
    python docs/mlx-vlm-repro/load_native_checkpoint.py models/tiny-needle-v2"""
import sys
from pathlib import Path

from mlx_vlm.utils import load_model

path = Path(sys.argv[1] if len(sys.argv) > 1 else "models/tiny-needle-v2")
try:
    load_model(path)
    print("loaded as shipped")
except ValueError as e:
    print("as shipped:", e)

import mlx_vlm.fp8  # noqa: E402

mlx_vlm.fp8.make_quantization_config = lambda config: None   # let DeepSeek-V4's own quantization decide
model = load_model(path)
experts = model.language_model.model.layers[0].ffn.switch_mlp.gate_proj
print("with the FP8 helper's claim lifted: loaded; routed experts", experts.mode, f"{experts.bits}-bit")
