"""benchmarks/compare_engines.py: the pagedserve-gguf and llamacpp-gguf engines run on the default model's own
file, and the tables give each other engine's ratio to every pagedserve variant that ran."""
import argparse
import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)
import compare_engines  # noqa: E402 - benchmarks/ is not a package

from pagedserve.loader.default_model import default_model_path  # noqa: E402


def _args(**overrides) -> argparse.Namespace:
    args = dict(num_prompts=8, input_len=4, output_len=2, dtype="auto", llamacpp_model=None, stream_interval=None,
                llama_server="/opt/llama-server", single_output_len=4, vllm_python="python", vllm_model="m")
    return argparse.Namespace(**{**args, **overrides})


def test_pagedserve_gguf_keeps_the_weights_quantized_and_pagedserve_does_not():
    gguf, _ = compare_engines.offline_command("pagedserve-gguf", _args(), "out.json")
    plain, _ = compare_engines.offline_command("pagedserve", _args(), "out.json")
    assert gguf[gguf.index("--quantization") + 1] == "gguf" and "--quantization" not in plain
    served, _ = compare_engines.server_command("pagedserve-gguf", _args(), 8000)
    assert served[served.index("--quantization") + 1] == "gguf"
    assert "--quantization" not in compare_engines.server_command("pagedserve", _args(), 8000)[0]


def test_llamacpp_gguf_runs_the_default_models_own_file():
    args = _args(llamacpp_model="/models/other.gguf")
    assert compare_engines.llamacpp_gguf(args, "llamacpp-gguf") == default_model_path()
    assert compare_engines.llamacpp_gguf(args, "llamacpp") == "/models/other.gguf"
    served, _ = compare_engines.server_command("llamacpp-gguf", args, 8000)
    assert served[served.index("--model") + 1] == default_model_path()


def test_offline_table_gives_a_ratio_column_per_pagedserve_variant():
    run = dict(load_s=1.0, exact=True, dtype="bfloat16")
    results = {"pagedserve": [dict(run, output_tok_s=600.0)], "pagedserve-gguf": [dict(run, output_tok_s=720.0)],
               "vllm": [dict(run, output_tok_s=480.0), dict(run, output_tok_s=500.0)]}
    header, _, ours, gguf, vllm = compare_engines.offline_table(results).splitlines()
    assert header.endswith("| pagedserve / engine | pagedserve-gguf / engine |")
    assert vllm.endswith("| **1.22x** | **1.47x** |")  # 600 / 490 and 720 / 490 (the median of two runs)
    assert ours.endswith("| | |") and gguf.endswith("| | |")
    only_vllm = compare_engines.offline_table({"vllm": results["vllm"]}).splitlines()[0]
    assert only_vllm.endswith("| exact lengths |")


def test_single_stream_table_ratios():
    results = {"pagedserve-gguf": [{"decode_tok_s": 200.0, "dtype": "Q4_1 kept"}],
               "llamacpp-gguf": [{"decode_tok_s": 100.0, "dtype": "Q4_1"}]}
    header, _, _, llamacpp = compare_engines.single_stream_table(results).splitlines()
    assert header.endswith("| pagedserve-gguf / engine |") and llamacpp.endswith("| **2.00x** |")


def test_stream_interval_goes_to_pagedserve_and_vllm_alike():
    for engine in ("pagedserve", "pagedserve-gguf", "vllm"):
        served, _ = compare_engines.server_command(engine, _args(stream_interval=4), 8000)
        assert served[served.index("--stream-interval") + 1] == "4"
        assert "--stream-interval" not in compare_engines.server_command(engine, _args(), 8000)[0]
