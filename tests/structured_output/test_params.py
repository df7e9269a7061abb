"""StructuredOutputsParams: exactly one constraint, fields checked on construction, a stable cache key."""

from __future__ import annotations

import pytest

from pagedserve import SamplingParams
from pagedserve.structured_output import StructuredOutputsParams


@pytest.mark.parametrize("kwargs, why", [
    ({}, "none"),
    ({"json": {"type": "object"}, "regex": "a+"}, "json, regex"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1, 2]}, "JSON schema object"),
    ({"regex": ""}, "regex"),
    ({"choice": []}, "choice"),
    ({"choice": ["a", 3]}, "choice"),
    ({"grammar": "  "}, "grammar"),
    ({"json_object": "yes"}, "json_object"),
])
def test_invalid_constraints_raise_naming_the_field(kwargs, why):
    with pytest.raises(ValueError, match=why):
        StructuredOutputsParams(**kwargs)


def test_the_key_is_the_same_for_the_same_schema_however_it_is_written():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    assert a.key() == b.key() and a.kind == "json"
    assert StructuredOutputsParams(choice=["x", "y"]).key() != StructuredOutputsParams(choice=["y", "x"]).key()


def test_sampling_params_take_a_dict_and_refuse_other_types():
    params = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="[0-9]+")
    assert params.child(1).structured_outputs == params.structured_outputs
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="[0-9]+")
