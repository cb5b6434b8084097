"""Checkpoint I/O in DeepSeek's native safetensors format (docs/research/dsv4-architecture.md §3): one import point.

    info = scan_checkpoint(path)                      # headers only, validated
    w = StreamingWeights(path, device="cuda")         # one layer resident at a time
    Model(w, Numerics()).prefill_logits(tokens)
    save_checkpoint(random_weights(tiny()), "out/")  # sharded, quantised, atomic
"""
from .checkpoint_format import (CheckpointError, DiskEntry, disk_entries, expected_entries,
                                read_header)
from .checkpoint_read import (CheckpointInfo, StreamingWeights, decode_fp4, decode_fp8,
                              load_checkpoint, scan_checkpoint)
from .checkpoint_write import (CheckpointWriter, encode, encode_fp4, encode_fp8, hf_config_dict,
                               save_checkpoint)

__all__ = ["CheckpointError", "DiskEntry", "disk_entries", "expected_entries", "read_header",
           "CheckpointInfo", "StreamingWeights", "decode_fp4", "decode_fp8", "load_checkpoint",
           "scan_checkpoint", "CheckpointWriter", "encode", "encode_fp4", "encode_fp8",
           "hf_config_dict", "save_checkpoint"]
