"""The needle sweep's in-process runner: one arm of the reference model answering the
haystack prompts, its trials batched layer-major (needle's HTTP runner is its peer)."""
