"""Keep freed CPU memory in the process. glibc hands every freed block above its mmap
threshold (at most 32 MB) back to the kernel and faults it in again, page by page, on the
next allocation of that size. The golden's CPU forward allocates such temporaries by the
hundred per layer (fp64 copies of a chunk's activations): at 4K tokens on the widened tiny
model a sixth of its time was the kernel zeroing pages (bench/results/prefill_vs_llama.md).
With every allocation served from the heap and no automatic trim, those pages stay mapped:
the resident set stays at its peak between layers instead of falling back, and explicit
trims (checkpoint_read._trim_heap after a streamed layer) still return free pages."""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4      # glibc's mallopt parameters
TOP_PAD = 1 << 26                                        # grow the heap 64 MB at a time

_done = False


def keep_freed_memory() -> bool:
    """Once per process: glibc's malloc told to serve large blocks from the heap and not to
    trim it on its own. False where the C library is not glibc (nothing changed)."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    _done = bool(mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, 1 << 40)
                 and mallopt(M_TOP_PAD, TOP_PAD))
    return _done
