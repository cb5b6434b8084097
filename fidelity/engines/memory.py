"""How much memory the in-process golden gives back before the engines are launched on the
same devices: the bytes of the tensors it held (weights and converted weight caches, each
storage counted once), CUDA's allocated bytes per device, and the process's resident set,
each measured before and after the release. The tensor bytes are the CPU figure to trust:
a freed CPU tensor need not shrink the resident set (the allocator may keep the pages,
though the heap is trimmed after the release)."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import types
import weakref

import torch

WALK_DEPTH = 6                   # objects -> dicts -> layers -> tensors is depth 4
NOT_WALKED = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


def rss_bytes() -> int | None:
    """The process's resident set now (Linux /proc), None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc malloc_trim), so the resident
    set shows what was freed; nothing where the C library has no malloc_trim."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def cuda_allocated(devices) -> dict[str, int]:
    """torch.cuda.memory_allocated of each CUDA device in `devices`."""
    return {d: int(torch.cuda.memory_allocated(torch.device(d))) for d in devices if d.startswith("cuda")}


def tensor_bytes(*roots) -> int:
    """Bytes of the distinct tensor storages reachable from `roots` through dicts, lists,
    tuples and objects' attributes (WALK_DEPTH levels)."""
    seen_obj, seen_storage, total = set(), set(), 0
    stack = [(r, 0) for r in roots]
    while stack:
        x, depth = stack.pop()
        if x is None or id(x) in seen_obj or depth > WALK_DEPTH:
            continue
        seen_obj.add(id(x))
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            key = (st.device.type, st.device.index, st.data_ptr())
            if key not in seen_storage:
                seen_storage.add(key)
                total += st.nbytes()
        elif isinstance(x, dict):
            stack += [(v, depth + 1) for v in x.values()]
        elif isinstance(x, (list, tuple)):
            stack += [(v, depth + 1) for v in x]
        elif hasattr(x, "__dict__") and not isinstance(x, NOT_WALKED):
            stack += [(v, depth + 1) for v in vars(x).values()]
    return total


def _ref(x):
    try:
        return weakref.ref(x)
    except TypeError:
        return None


def release(holder: dict, devices) -> dict:
    """Drop everything `holder` holds (name -> object: weights, scorers, caches), collect,
    empty CUDA's cache; the memory before and after, and whether every dropped object is
    really gone (nothing else kept a reference)."""
    cuda = any(d.startswith("cuda") for d in devices)
    held = tensor_bytes(*holder.values())
    refs = [r for r in (_ref(v) for v in holder.values()) if r is not None]
    before = {"rss": rss_bytes(), "cuda": cuda_allocated(devices) if cuda else {}}
    holder.clear()
    gc.collect()
    trim_heap()
    if cuda:
        torch.cuda.empty_cache()
    after = {"rss": rss_bytes(), "cuda": cuda_allocated(devices) if cuda else {}}
    out = {"tensor_bytes": held, "all_dropped": all(r() is None for r in refs),
           "rss_before": before["rss"], "rss_after": after["rss"]}
    if cuda:
        out["cuda"] = {d: {"allocated_before": b, "allocated_after": after["cuda"][d],
                           "freed": b - after["cuda"][d]} for d, b in before["cuda"].items()}
    return out


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def describe(r: dict) -> str:
    """A release in words, for the run log."""
    parts = [f"{_size(r['tensor_bytes'])} of weights and weight caches dropped"
             + ("" if r["all_dropped"] else " (some still referenced elsewhere: not all freed)")]
    for d, c in (r.get("cuda") or {}).items():
        parts.append(f"{d} allocated {_size(c['allocated_before'])} -> {_size(c['allocated_after'])} "
                     f"({_size(c['freed'])} freed)")
    if r["rss_before"] is not None:
        parts.append(f"process RSS {_size(r['rss_before'])} -> {_size(r['rss_after'])}")
    return "; ".join(parts)
