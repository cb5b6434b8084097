"""The verdict, one sequence for `fidelity ab`, `fidelity kld` and `fidelity engines`:
per-prompt signals (signals.py) -> summaries with CIs -> floors -> attribution
(attribution.py) -> verdict and judged tables (judge.py); board.py renders the judged
tables for the reports (signals board, suspects). A new signal is defined and extracted in
signals.py; nothing outside this package changes."""
