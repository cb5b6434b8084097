"""`fidelity chat-check`: request-level fidelity (cases, probe, check, report)."""
