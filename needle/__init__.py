"""Needle-in-a-haystack recall sweeps (RULER-style haystacks sized exactly in the target
tokenizer), in-process over reference-model arms and over any OpenAI-compatible server.
The in-process runner is built from an arm, so it lives in fidelity (fidelity.needle_run.runner);
needle imports nothing of fidelity.

    haystack   needle kinds, values, filler, exact-length prompt building
    keys       needle keys and values: random, or near-duplicates of the queried key
    http       httpx async runner: bounded concurrency, timeouts, retries, /tokenize counting
    sweep      lengths x depths x reps over arms, append-only JSONL with resume
    scoring    substring scoring and the failure taxonomy
    stats      Wilson intervals, McNemar
    tables     tidy result tables;  report  the report directory
    stub       a deterministic (optionally misbehaving) OpenAI-compatible stub server
"""
