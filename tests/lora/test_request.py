"""LoRARequest: vLLM's fields, validated; importable from the package without torch; picklable."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from pagedserve import LoRARequest


def test_fields_are_vllms_and_it_pickles():
    lora = LoRARequest("sql", 3, "/adapters/sql")
    assert (lora.lora_name, lora.lora_int_id, lora.lora_path) == ("sql", 3, "/adapters/sql")
    assert pickle.loads(pickle.dumps(lora)) == lora


@pytest.mark.parametrize("kwargs, field", [
    (dict(lora_name="", lora_int_id=1), "lora_name"),
    (dict(lora_name="a", lora_int_id=0), "lora_int_id"),
    (dict(lora_name="a", lora_int_id=True), "lora_int_id"),
    (dict(lora_name="a", lora_int_id="1"), "lora_int_id"),
    (dict(lora_name="a", lora_int_id=1, lora_path=None), "lora_path"),
])
def test_invalid_fields_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LoRARequest(**kwargs)


def test_importing_it_from_the_package_does_not_import_torch():
    code = "import sys; from pagedserve import LoRARequest; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
