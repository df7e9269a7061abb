"""The throughput benchmark on a tiny random model: the result dict is complete and sane."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedserve.benchmarks import step_profile, throughput


def _args(*argv: str) -> argparse.Namespace:
    return throughput.add_cli_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_defaults_are_workload_w1():
    args = _args()
    assert (args.num_prompts, args.input_len, args.output_len, args.seed) == (256, 128, 128, 0)
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.backend, args.hf_batch_size) == (256, None, "both", 32)
    assert args.model is None and args.dtype == "auto" and not args.profile and args.output_json is None


def test_prompt_ids_are_seeded_and_clamped_to_the_vocabulary():
    assert throughput.prompt_id_range(49152) == (100, 49000)
    assert throughput.prompt_id_range(400) == (100, 400)
    assert throughput.prompt_id_range(50) == (0, 50)
    a = throughput.make_prompts(3, 16, 400, seed=0)
    assert a == throughput.make_prompts(3, 16, 400, seed=0)
    assert a != throughput.make_prompts(3, 16, 400, seed=1)
    assert all(len(p) == 16 and all(100 <= t < 400 and isinstance(t, int) for t in p) for p in a)


def test_tiny_model_both_backends_with_profile(tiny_llama_dir, tmp_path):
    out_json = tmp_path / "result.json"
    args = _args("--model", tiny_llama_dir, "--dtype", "float32", "--device", "cpu", "--num-prompts", "4",
                 "--input-len", "8", "--output-len", "4", "--max-num-seqs", "8", "--hf-batch-size", "3",
                 "--kv-cache-memory-bytes", str(1 << 20), "--backend", "both", "--profile",
                 "--profile-torch-steps", "1", "--output-json", str(out_json))
    result = throughput.main(args)

    for backend in ("pagedserve", "hf"):
        r = result[backend]
        assert r["num_requests"] == 4
        assert r["output_tokens"] == 4 * 4 and r["prompt_tokens"] == 4 * 8
        assert r["all_exact_output_len"] and r["num_wrong_output_len"] == 0
        assert r["elapsed_s"] > 0 and r["load_s"] > 0
        assert r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"] and r["requests_per_s"] > 0
    assert result["speedup_output_tok_s"] == pytest.approx(
        result["pagedserve"]["output_tok_s"] / result["hf"]["output_tok_s"])
    # Same weights, float32, greedy: the two backends should mostly agree token for token.
    assert 0.0 <= result["greedy_agreement"]["exact_requests"] <= 1.0
    assert result["greedy_agreement"]["mean_common_prefix"] > 0.5
    assert result["workload"]["prompt_id_range"][1] <= 400  # clamped to the tiny vocabulary

    profile = result["profile"]
    labels = [label for label, *_ in step_profile.PROFILE_ROWS] + [step_profile.PROFILE_OTHER]
    assert list(profile["rows"]) == labels
    assert profile["steps"] >= 1 and profile["wall_s"] > 0
    assert sum(row["seconds"] for row in profile["rows"].values()) == pytest.approx(profile["wall_s"])
    for label in ("model forward (excl. attention)", "attention", "sampling", "scheduling", "input preparation",
                  "output processing"):
        assert profile["rows"][label]["seconds"] > 0, label
    assert profile["details"]["attention"]["calls"] >= 2 * profile["steps"]  # 2 layers per step
    assert profile["torch_profiler"] is not None and profile["torch_profiler"]["top_ops"]

    # The timers are gone again: a plain run after profiling still works and is unpatched.
    import pagedserve.attention.torch_paged as torch_paged
    import pagedserve.models.llama as llama

    assert llama.paged_attention is torch_paged.paged_attention
    assert json.loads(out_json.read_text())["pagedserve"]["output_tokens"] == 16


def test_profile_restores_the_engine(tiny_llama_dir):
    args = _args("--model", tiny_llama_dir, "--dtype", "float32", "--device", "cpu", "--num-prompts", "2",
                 "--input-len", "4", "--output-len", "3", "--kv-cache-memory-bytes", str(1 << 20),
                 "--no-warmup")
    backend = throughput.PagedserveBackend(args)
    engine = backend.llm.engine
    before = {"engine": dict(vars(engine)), "runner": dict(vars(engine.runner)),
              "model": set(vars(engine.runner.model)), "scheduler": dict(vars(engine.scheduler)),
              "output_processor": dict(vars(engine.output_processor))}
    prompts = throughput.make_prompts(2, 4, 400, seed=0)
    step_profile.profile_run(backend, prompts, 3, torch_steps=0)
    assert set(vars(engine.runner.model)) == before["model"]
    for name, obj in (("engine", engine), ("runner", engine.runner), ("scheduler", engine.scheduler),
                      ("output_processor", engine.output_processor)):
        assert set(vars(obj)) == set(before[name]), name
        for key in ("step", "add_request", "sampler", "schedule", "process"):
            if key in before[name]:
                assert vars(obj)[key] is before[name][key]
    run = backend.generate(prompts, 3)
    assert [len(t) for t in run.token_ids] == [3, 3]


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num-prompts"):
        throughput.main(_args("--num-prompts", "0"))
    with pytest.raises(ValueError, match="profile"):
        throughput.main(_args("--backend", "hf", "--profile"))


@pytest.mark.parametrize("backend", ["pagedserve", "hf"])
def test_one_backend_with_repeats(tiny_llama_dir, backend):
    args = _args("--model", tiny_llama_dir, "--dtype", "float32", "--device", "cpu", "--num-prompts", "3",
                 "--input-len", "5", "--output-len", "2", "--kv-cache-memory-bytes", str(1 << 20),
                 "--backend", backend, "--repeats", "2", "--no-warmup")
    result = throughput.main(args)
    other = "hf" if backend == "pagedserve" else "pagedserve"
    assert result[other] is None and result["speedup_output_tok_s"] is None and result["profile"] is None
    r = result[backend]
    assert len(r["elapsed_s_all"]) == 2 and r["all_exact_output_len"] and r["output_tokens"] == 6
    assert r["output_tok_s"] > 0


def test_quantization_gguf_keeps_the_files_weights_quantized(tiny_llama_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from pagedserve.loader.gguf_writer import write_gguf

    gguf = str(tmp_path / "tiny-Q8_0.gguf")
    write_gguf(AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32), gguf, quant="Q8_0")
    argv = ["--model", gguf, "--dtype", "float32", "--device", "cpu", "--num-prompts", "2", "--input-len", "5",
            "--output-len", "3", "--kv-cache-memory-bytes", str(1 << 20), "--backend", "pagedserve"]
    kept = throughput.PagedserveBackend(_args(*argv, "--quantization", "gguf"))
    dense = throughput.PagedserveBackend(_args(*argv))
    assert all(layer.mlp.down_proj.quantized is not None for layer in kept.llm.engine.runner.model.model.layers)
    assert all(layer.mlp.down_proj.quantized is None for layer in dense.llm.engine.runner.model.model.layers)
    result = throughput.main(_args(*argv, "--quantization", "gguf", "--no-warmup"))
    assert result["workload"]["quantization"] == "gguf"
    assert result["pagedserve"]["all_exact_output_len"] and result["pagedserve"]["output_tokens"] == 6
