"""DeepSeek-V4.1 in the golden: what V4.1 adds to the V4 code base, one module per job
(docs/v41-architecture.md is the spec).

    config       V41Config from either config dialect, validated; presets v41_flash, tiny_v41
    engram       Engram constants: prime bucket layout, hash multipliers, compressed vocabulary
    specs        the V4.1 tensor table in DeepSeek-native names (32x32 FP8, Engram tables)
    checkpoint_format / checkpoint_read / checkpoint_write
                 V4.1 safetensors entries, scan + validate + load, and a writer for tests
    weights      seeded random weights for any V4.1 config; EngramTable (host-resident tables)
    resident     V41QuantisedResidentWeights: checkpoint form resident, dequantised on use
    sizes        tensor bytes and per-sequence state for `fidelity plan-memory`
    kernels      the new steps as pure functions (Engram, compressors, indexer, candidates,
                 lagged mHC, KV fake-quant), called through the seam by the V4.1 model
    numerics     those steps as seam kernels (V41Kernels, the base class of Numerics; V41_KERNELS)
    stream       the residual stream between layers: H with the lagged mHC pre-mix packed in
    model        ModelV41: the V4.1 forward with V4's Model API (reference_model.build_model)

V4 stays in reference_model/*.py; `is_v41(cfg)` tells the two apart."""
from __future__ import annotations


def is_v41(cfg) -> bool:
    """Is this a DeepSeek-V4.1 config object (V41Config) rather than V4's ModelConfig?"""
    return getattr(cfg, "version", "v4") == "v4.1"
