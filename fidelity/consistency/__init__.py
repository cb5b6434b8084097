"""`fidelity consistency`: does a live engine give the same answer however a request is
served? Probe families send the same prompt under a serving condition and without it and
compare the replies; the judge names the condition that changes the answer.

client.py   a live endpoint: greedy replies with logprobs, cached-token counts, flush
compare.py  two replies: bit-identical, where greedy tokens part, KL before they part
family.py   what the families share (arm, store, plan, reference, row keys)
prefix.py   the prefix-cache family (hits at each boundary class, multi-turn, eviction vs cold)
batch.py    the batch family (alone vs with requests in flight)
chunk.py    the chunked-prefill family (KL at the prefill chunk boundaries vs a reference)
longgen.py  the long-generation family (drift along the engine's own output, behaviour)
serial.py   distributions as JSON for the store
store.py    finished probes, append-only JSONL (resume)
judge.py    each condition against the arm's floor; the verdict sentences
report.py   the report (house format)
run.py      the run: families over endpoints, judge, report"""
