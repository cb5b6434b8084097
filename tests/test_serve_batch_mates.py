"""`fidelity serve`'s scheduler runs requests one forward at a time, but a step's
batch-dependent kernels see the tokens the other live requests on the same model bring to
it (an engine's continuous batch): their prompt while it is pending, then one token per
decode step. Requests on another model are not batch-mates, and the golden's numerics do
not read the count, so its answers do not change under load."""
import asyncio
import threading
import time

from fidelity.serve.scheduler import Job, Scheduler
from reference_model import Model, Numerics
from reference_model.config import tiny
from reference_model.generate import Decoder
from reference_model.schedule import batch_tokens
from reference_model.weights import random_weights

LOG: list = []


class Recording(Numerics):
    """Reference numerics that write down the step's token count at every mHC pre-mix."""

    def hc_pre(self, *a, **kw):
        LOG.append(batch_tokens())
        return super().hc_pre(*a, **kw)


class Rec(Decoder):
    """A Decoder that keeps the token counts its own forwards saw, one set per step."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list[set] = []

    def step(self):
        n = len(LOG)
        tok = super().step()
        self.seen.append(set(LOG[n:]))
        return tok


class Gate(Decoder):
    """Holds the worker until released, so the jobs behind it are all queued first."""

    def __init__(self, model, release: threading.Event):
        super().__init__(model, [1], 1)
        self.release = release

    def step(self):
        self.release.wait(60)
        self.done = True


def _wait(decoders, timeout=300.0):
    end = time.monotonic() + timeout
    while not all(d.done for d in decoders):
        assert time.monotonic() < end, "scheduler did not finish"
        time.sleep(0.01)


def test_steps_see_their_batch_mates_tokens():
    w = random_weights(tiny(), 1)
    model, other = Model(w, Recording("reference")), Model(w, Recording("reference"))
    ids_a, ids_b, ids_c = list(range(10, 20)), list(range(30, 37)), list(range(40, 45))
    a, b = Rec(model, ids_a, 3), Rec(model, ids_b, 3)
    c = Rec(other, ids_c, 2)                         # another model: not a batch-mate
    release, loop = threading.Event(), asyncio.new_event_loop()
    sched = Scheduler(time_slice=0.0)                # one step per turn while others wait
    sched.submit(Job(Gate(model, release), loop))
    for d in (a, b, c):
        sched.submit(Job(d, loop))
    release.set()
    _wait([a, b, c])
    assert a.seen[0] == {10 + 7}                     # A's prompt with B's pending prompt
    assert b.seen[0] == {7 + 1}                      # B's prompt with A's next decode token
    assert a.seen[1] == b.seen[1] == {2}             # two decoding requests
    assert c.seen[0] == {5} and all(s == {1} for s in c.seen[1:])
    alone = Decoder(Model(w, Numerics("reference")), ids_a, 3).run()
    assert a.out.tokens == alone.tokens              # the golden does not read the count
    loop.close()


def test_next_tokens_is_the_prompt_then_one():
    d = Decoder(Model(random_weights(tiny(), 1), Numerics("reference")), [5, 6, 7], 2)
    assert d.next_tokens() == 3
    d.step()
    assert d.next_tokens() == 1
    d.run()
    assert d.next_tokens() == 0
