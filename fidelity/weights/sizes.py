"""Byte sizes as people write them: 96GB, 141 GiB, 512MiB, 1.5T, 4096 (bytes)."""
from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.I)


def parse_bytes(text) -> int:
    """K/M/G/T are decimal, Ki/Mi/Gi/Ti binary, the trailing B optional; a bare number is
    bytes."""
    m = _SIZE.match(str(text))
    if not m or (m.group(3) and not m.group(2)):
        raise ValueError(f"cannot read size {text!r} (e.g. 96GB, 141GiB, 512MiB, or bytes)")
    num, unit, binary = float(m.group(1)), m.group(2).lower(), bool(m.group(3))
    power = "kmgt".index(unit) + 1 if unit else 0
    return int(num * ((1024 if binary else 1000) ** power))
