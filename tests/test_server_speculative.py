"""`fidelity serve --speculative-tokens K` as a real server process: the same requests on a
server with speculation and one without give the same answers bit for bit (greedy and
seeded sampling, tokens and logprobs, through the prefix cache), SGLang's meta_info
reports the verifies, /get_server_info the totals; bad settings are named."""
import subprocess

import httpx
import pytest

from checkpoint_util import tiny_mtp_checkpoint
from needle_util import ROOT, fidelity_cmd, ok, served
from reference_model import random_weights, tiny
from reference_model.checkpoint_write import save_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_mtp_checkpoint(tmp_path_factory.mktemp("spec") / "tiny-mtp")


def _complete(url, prompt, **kw):
    body = {"model": "m", "prompt": prompt, "max_tokens": 12, "logprobs": 2, **kw}
    c = ok(httpx.post(url + "/v1/completions", json=body, timeout=300))["choices"][0]
    return c["text"], c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"], c["finish_reason"]


def test_spec_server_answers_as_the_plain_server():
    """On the embedded tiny-needle-v2 and its trained MTP layer: drafts are accepted (runs
    of every length), and every answer is the plain server's."""
    base = ("--checkpoint", "tiny-needle-v2", "--model-name", "m", "--page-size", "16")
    with served("golden", extra=base + ("--speculative-tokens", "2")) as (spec,), \
            served("golden", extra=base) as (plain,):
        prompts = ["The special magic number for quiet harbor is 4412345. " * 3 +
                   "What is the special magic number for quiet harbor?", "Once upon a time " * 9]
        for p in prompts:
            for kw in ({"temperature": 0}, {"temperature": 0.8, "seed": 5},
                       {"temperature": 1.2, "top_p": 0.9, "seed": 9}):
                a, b = _complete(spec, p, **kw), _complete(plain, p, **kw)
                assert a == b, (p, kw)
        again = _complete(spec, prompts[0], temperature=0)       # a prefix-cache hit
        assert again == _complete(plain, prompts[0], temperature=0)
        g = ok(httpx.post(spec + "/generate", json={"text": prompts[1], "sampling_params": {
            "max_new_tokens": 8, "temperature": 0}}, timeout=300))
        assert g["meta_info"]["spec_verify_ct"] >= 1
        assert len(g["meta_info"]["spec_accepted_per_position"]) == 2
        info = ok(httpx.get(spec + "/get_server_info"))["speculative"]
        assert info["enabled"] and info["num_speculative_tokens"] == 2 and info["verifies"] > 0
        assert info["accepted_per_position"][1] > 0            # the trained MTP's drafts are taken
        assert ok(httpx.get(plain + "/get_server_info"))["speculative"] == {"enabled": False}


@pytest.mark.parametrize("args,msg", [
    (("--speculative-tokens", "-1"), "--speculative-tokens must be >= 0"),
    (("--speculative-tokens", "40", "--checkpoint", "{ckpt}"), "shorter than the sliding window"),
    (("--speculative-tokens", "2", "--checkpoint", "{plain}"), "num_nextn_predict_layers=0"),
])
def test_bad_speculative_settings_are_named(ckpt, tmp_path, args, msg):
    plain = tmp_path / "plain"
    save_checkpoint(random_weights(tiny(), 0), plain)
    args = [a.format(ckpt=ckpt, plain=plain) for a in args]
    p = subprocess.run(fidelity_cmd("serve", "--port", "0", *args), cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and msg in p.stderr, p.stderr[-2000:]
