"""Subcommands of the `fidelity` CLI."""
