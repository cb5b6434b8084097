"""`fidelity chat-check --chat-version auto` (the default): which encoding a deployment is
checked against, from what the server says about its model, in the shapes SGLang, vLLM and
`fidelity serve` answer with."""
import pytest

from fidelity.chat_check.version import served_chat_version


@pytest.mark.parametrize("info, want", [
    # SGLang: /get_model_info's model_path (and /get_server_info's)
    ({"models": ["default"], "model_info": {"model_path": "deepseek-ai/DeepSeek-V4.1-Flash"}},
     ("v41", "model_info.model_path 'deepseek-ai/DeepSeek-V4.1-Flash'")),
    ({"models": ["m"], "server_info": {"model_path": "/models/dsv4_1-flash-fp8"}},
     ("v41", "server_info.model_path '/models/dsv4_1-flash-fp8'")),
    # vLLM: the served model id is the model path unless renamed
    ({"models": ["deepseek-ai/DeepSeek-V41-Flash"]}, ("v41", "model id 'deepseek-ai/DeepSeek-V41-Flash'")),
    # a reported architecture is what the server loaded: it decides before any name
    ({"models": ["DeepSeek-V4.1"], "model_info": {"architecture": "DeepseekV4ForCausalLM"}},
     ("v4", "architecture DeepseekV4ForCausalLM")),
    ({"models": ["DeepSeek-V4.1"], "model_info": {"architecture": "LlamaForCausalLM"}},
     ("v41", "model id 'DeepSeek-V4.1'")),
    ({"models": ["x"], "model_info": {"architecture": "DeepseekV41ForCausalLM"}},
     ("v41", "architecture DeepseekV41ForCausalLM")),
    # V4 and names that only look alike
    ({"models": ["deepseek-ai/DeepSeek-V4-Flash"], "model_info": {"model_path": "/m/DeepSeek-V4-Pro"}},
     ("v4", "no DeepSeek-V4.1 name served")),
    ({"models": ["DeepSeek-V4.10-preview", "v410"]}, ("v4", "no DeepSeek-V4.1 name served")),
    ({"models": ["golden"], "model_info": {"architecture": "DeepseekV4ForCausalLM"}},
     ("v4", "architecture DeepseekV4ForCausalLM")),
    (None, ("v4", "no DeepSeek-V4.1 name served")),
    ({"models": None, "model_info": None, "server_info": "not a dict"}, ("v4", "no DeepSeek-V4.1 name served")),
])
def test_served_chat_version(info, want):
    assert served_chat_version(info) == want
