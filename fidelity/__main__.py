"""`python -m fidelity ...`: the CLI, as torchrun launches it (`torchrun ... -m fidelity ab --distributed`)."""
import sys

from fidelity.cli import main

sys.exit(main())
