import pytest
import torch
from transformers import LlamaConfig

from pagedserve.layers.rotary import inverse_frequencies


def _config(factor):
    return LlamaConfig(hidden_size=64, num_attention_heads=4,
                       rope_parameters={"rope_type": "linear", "factor": factor, "rope_theta": 10000.0})


def test_scaled_rope_tables_are_computed_on_the_cpu_while_the_model_is_built_on_meta():
    with torch.device("meta"):
        inv_freq, scaling = inverse_frequencies(_config(2.0), 16)
    assert inv_freq.device.type == "cpu" and scaling == 1.0
    assert torch.equal(inv_freq, inverse_frequencies(_config(1.0), 16)[0] / 2.0)


def test_a_rope_factor_of_none_is_a_type_error_even_on_meta_not_a_meta_copy_error():
    # TypeError is one of the loader's _BUILD_ERRORS, which it reports as a ValueError naming config.json
    with torch.device("meta"), pytest.raises(TypeError):
        inverse_frequencies(_config(None), 16)
