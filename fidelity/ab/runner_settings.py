"""How a lockstep run goes (RunnerSettings, ABSettings' `runner` part), the chunk sizes it
computes in (Chunking), and where it runs and who hears of it (RunSite): the lockstep's
parameter objects, apart from lockstep.py so design.py can hold them without a circle."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# Taps compared by default: cheap enough for long contexts on a real checkpoint.
DEFAULT_TAPS = ("layers.*.attn.kv", "layers.*.attn.index.topk", "layers.*.attn.out",
                "layers.*.hc_attn.comb", "layers.*.ffn.router.experts", "layers.*.ffn.out",
                "layers.*.out")


@dataclass(frozen=True)
class RunnerSettings:
    """How the lockstep runs: mode, decode steps, taps kept, placement, accumulation."""
    mode: str = "propagated"
    decode_steps: int = 4
    taps: tuple[str, ...] = DEFAULT_TAPS
    keep: tuple[str, ...] = ()
    devices: tuple[str, ...] = ("cpu",)    # layers placed across these (fidelity.weights.devices)
    accumulate: str = "float64"            # golden's accumulation dtype (torch dtype name)
    activation_budget: int | None = None   # bytes of residual streams kept in memory per pass


@dataclass(frozen=True)
class Chunking:
    """Positions per layer call and per head call; not ab settings, so kept apart from them."""
    tokens: int = 2048                     # the layers' chunk (build_model's chunk_tokens)
    head: int | None = None                # the head's (fidelity.ab.head); None: the layers'


@dataclass(frozen=True)
class RunSite:
    """Where a lockstep run happens and who hears of it, the same for each of its calls."""
    progress: Callable[[str], None] | None = None   # progress lines (None: none)
    stage: object = None                   # this rank's fidelity.pipeline.stage.Stage: only its layers run here
