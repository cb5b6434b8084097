"""fidelity package."""
