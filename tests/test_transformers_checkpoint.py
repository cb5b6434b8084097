"""An outside check on loading: a tiny DeepSeek-V4 built by transformers and saved by its
own `save_pretrained` (its naming, its config field names, fp32 tensors) loads through our
reader and gives transformers' own logits in the `exact` profile (the indexer tie order
bridged as tests/test_transformers_oracle.py does); a missing layer is named."""
import pytest
import torch

pytest.importorskip("transformers")

from hf_oracle import build_hf_model, hf_logits  # noqa: E402

from reference_model import Model, Numerics, tiny  # noqa: E402
from reference_model.checkpoint import CheckpointError, load_checkpoint, scan_checkpoint  # noqa: E402
from reference_model.weights import random_weights  # noqa: E402

W = random_weights(tiny(), seed=0)
TOKENS = torch.randint(2, 500, (130,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    hf = build_hf_model(W.cfg, W)
    hf.save_pretrained(d, safe_serialization=True)
    return d, hf


def test_transformers_saved_checkpoint_matches_transformers_logits(saved):
    d, hf = saved
    info = scan_checkpoint(d)
    assert info.naming == "transformers" and info.layout == "native-dense"
    ours = load_checkpoint(d)
    assert ours.cfg.differences(W.cfg) == []
    for n, v in W.tensors.items():                       # the values transformers held
        assert torch.equal(ours.tensors[n].to(v.dtype), v), n
    with torch.no_grad():
        want = hf_logits(hf, TOKENS).double()
    got = Model(ours, Numerics("exact")).prefill_logits(TOKENS).double()
    rel = float((got - want).norm() / want.norm())
    assert rel <= 1e-4, rel


def test_missing_layer_is_named(saved, tmp_path):
    from safetensors.torch import load_file, save_file
    d, _ = saved
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    t = {k: v for k, v in load_file(d / "model.safetensors").items() if not k.startswith("model.layers.3.")}
    save_file(t, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor: layers\.3\.attn\.kv_norm\.weight"):
        scan_checkpoint(tmp_path)
