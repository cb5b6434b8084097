"""`fidelity consistency`: does a live engine give the same answer however a request is
served? Probe families send the same prompt under a serving condition and without it and
compare the replies; the judge names the condition that changes the answer.

client.py   a live endpoint: greedy replies with logprobs, cached-token counts, flush
compare.py  two replies: bit-identical, where greedy tokens part, KL before they part
prefix.py   the prefix-cache family (hits at each boundary class vs cold)
store.py    finished probes, append-only JSONL (resume)
judge.py    each condition against the arm's floor; the verdict sentences
report.py   the report (house format)
run.py      the run: families over endpoints, judge, report"""
