"""`fidelity ab`: golden vs engine numerics layer by layer, in lockstep.

design.py  the settings and the arms (toggle design, floor arms, factorial stage)
lockstep.py  the runner: every arm runs layer i before any runs layer i+1
metrics.py  per-tap comparisons (rel L2, cosine, SQNR, top-k recall, KLD, ...)
drift.py  drift as a multiple of the floor, first divergence
run.py  run_ab: prompts -> design -> lockstep -> fidelity.verdict.judge -> report
plots.py, report.py  the report's figures and page

The verdict (signals, floors, attribution) is fidelity.verdict, shared with kld/engines."""
