"""Write models/tiny-v41: the embedded DeepSeek-V4.1 checkpoint, seeded random weights on the
tiny V4.1 config (every V4.1 mechanism at test lengths). No tokenizer.json: its vocabulary is
the shipped tiny tokenizer's, which Engram then reads its compressed vocabulary from, and
commands prompt it with token ids (as a checkpoint written by the tests is). Not trained: the V4.1 training forward does not
exist yet (training/forward.py is V4's); MODEL_CARD.md says what that can and cannot show.

    python -m training.make_tiny_v41 [--out models/tiny-v41]

Deterministic: the same bits as `random_weights(tiny_v41(), 0)`, which the V4.1 tests use
(tests/test_v41_checkpoint.py checks the shipped folder against it)."""
from __future__ import annotations

import argparse
from pathlib import Path

from reference_model.v41.checkpoint_write import save_checkpoint
from reference_model.v41.config import tiny_v41
from reference_model.weights import random_weights

SEED = 0


def build(out: Path) -> Path:
    """The checkpoint (one shard + index + config.json) in `out`."""
    return save_checkpoint(random_weights(tiny_v41(), SEED), out, overwrite=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="models/tiny-v41")
    a = p.parse_args(argv)
    card = Path(a.out) / "MODEL_CARD.md"
    keep = card.read_text() if card.is_file() else None         # the card is written by hand
    build(Path(a.out))
    if keep is not None:
        card.write_text(keep)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
