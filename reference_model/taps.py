"""Named intermediate tensors ("taps"), captured only when asked for.

Names are stable across the project (`embed`, `layers.7.attn.index.topk`,
`layers.7.hc_attn.comb`, `layers.7.out`, `final_hidden`, `logits`) so reports, notebooks
and engine dumps can join on them. A tap written several times in one forward (chunked
prefill) is concatenated along the token axis, unless it matches a `latest` pattern: then
only its newest part is kept (a per-chunk row needed for the last position alone, whose
earlier chunks would otherwise pile up with chunks × width)."""
from __future__ import annotations

import fnmatch

import torch


class Taps:
    def __init__(self, patterns: list[str] | str = "*", keep_on_cpu: bool = True,
                 latest: list[str] = ()):
        self.patterns = [patterns] if isinstance(patterns, str) else list(patterns)
        self.keep_on_cpu = keep_on_cpu
        self.latest = list(latest)
        self._parts: dict[str, list[torch.Tensor]] = {}

    def __bool__(self) -> bool:          # `if taps:` means "capture is on"
        return True

    def wants(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def put(self, name: str, value: torch.Tensor) -> None:
        if self.wants(name):
            v = value.detach()
            v = v.cpu() if self.keep_on_cpu else v.clone()
            if any(fnmatch.fnmatchcase(name, p) for p in self.latest):
                self._parts[name] = [v]
            else:
                self._parts.setdefault(name, []).append(v)

    def names(self) -> list[str]:
        return list(self._parts)

    def get(self, name: str) -> torch.Tensor:
        try:
            parts = self._parts[name]
        except KeyError:
            raise KeyError(f"tap {name!r} was not captured; captured: {', '.join(self._parts) or 'none'}") from None
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)

    def parts(self, name: str) -> list[torch.Tensor]:
        """The captured parts of one tap, in the order they were written."""
        return list(self._parts[name])

    def last(self, name: str) -> torch.Tensor:
        """The last captured part alone (parts of a per-chunk tap may differ in width)."""
        return self._parts[name][-1]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._parts

    def clear(self) -> None:
        self._parts.clear()
