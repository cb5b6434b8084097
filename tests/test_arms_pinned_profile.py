"""An arm spelling can pin its numerics profile (`exact:...`, fidelity.design.arms.parse_arm):
a pinned arm such as llama.cpp's in-process twin (fidelity.llamacpp.flags.twin) in kld, needle and
serve. The pinned arm computes on its profile whatever profile the caller asks for, and
equals the same toggles built on that profile directly."""
import pytest
import torch

from fidelity.design.arms import ArmError, parse_arm, pinned_profile
from fidelity.pipeline.model import arm_numerics
from kernel_toggles import ToggleSet
from reference_model import Model, Numerics, random_weights, tiny


def test_spelling_name_and_schedule():
    a = parse_arm("exact:expert_act_q8_0,kv_cache_ggml@chunked(64)")
    assert a.name == "exact:kv_cache_ggml,expert_act_q8_0@chunked(64)" and str(a.schedule) == "chunked(64)"
    assert a.numerics("reference").profile == "exact"
    assert parse_arm("exact:").name == "exact:golden" and parse_arm("exact:").numerics().profile == "exact"
    assert parse_arm("reference:kv_bf16").numerics("exact").profile == "reference"
    assert pinned_profile("engine:sglang") == (None, "engine:sglang")      # an engine, not a profile
    with pytest.raises(ArmError, match="exactly"):
        parse_arm("exactly:kv_bf16")


def test_pinned_arm_computes_what_its_toggles_compute_on_that_profile():
    w = random_weights(tiny(), 0)
    ids = torch.randint(0, tiny().vocab_size, (40,), generator=torch.Generator().manual_seed(4))
    twin = Model(w, arm_numerics("exact:expert_act_q8_0,kv_cache_ggml", "reference")).prefill_logits(ids)
    same = Model(w, ToggleSet.parse("expert_act_q8_0,kv_cache_ggml").numerics("exact")).prefill_logits(ids)
    golden = Model(w, Numerics("reference")).prefill_logits(ids)
    assert torch.equal(twin, same) and not torch.equal(twin, golden)
