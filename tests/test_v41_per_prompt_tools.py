"""The per-prompt tools on a DeepSeek-V4.1 model in one process (issue 25): the serving
prefix cache restores V4.1's whole sequence state (Engram history, last index-key writer)
so a hit gives the cold logits bit for bit."""
import pytest
import torch

from fidelity.serve.prefix_cache import PrefixCache, page_keys, paged_prefill, restore
from reference_model import build_model
from reference_model.v41.config import tiny_v41
from reference_model.v41.weights import random_weights

CFG = tiny_v41()
PAGE = 16


@pytest.fixture(scope="module")
def model():
    return build_model(random_weights(CFG, 0))


def _ids(n, seed):
    return torch.randint(3, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def test_prefix_cache_hit_equals_cold_on_v41(model):
    a = _ids(70, 1)
    b = torch.cat([a[:50], _ids(20, 2)])                 # shares 50 tokens: 48 page-aligned
    cache = PrefixCache(PAGE)
    paged_prefill(model, a, model.new_state(), cache, page_keys("g", a.tolist(), PAGE), False)
    keys = page_keys("g", b.tolist(), PAGE)
    n, stored = cache.lookup(keys, len(b), len(b))
    assert n == 48
    hit, _ = paged_prefill(model, b, restore(model, stored), cache, keys, True)
    cold, _ = paged_prefill(model, b, model.new_state(), None, keys, True)
    assert torch.equal(hit, cold[n:])
    again, _ = paged_prefill(model, b, restore(model, stored), None, keys, False)
    assert torch.equal(again, cold[-1:])                 # the stored snapshot was not touched
