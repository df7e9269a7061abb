"""Export a GGUF checkpoint (default: pagedserve's default model) as a Hugging Face model folder.

    python benchmarks/export_hf.py [--model FILE.gguf] [--out /work/engines/smollm2-hf] [--dtype bfloat16]

The folder is what other engines (vLLM, transformers) load, so that they run on exactly the weights pagedserve
runs on: everything comes from pagedserve's own loader (``open_checkpoint``):

* config.json: the checkpoint's HF config (LlamaConfig for llama GGUFs: architectures, vocab size,
  tie_word_embeddings, rope_parameters with rope_theta, rms_norm_eps, bos/eos ids), with ``dtype`` set;
* model.safetensors: ``iter_weights(dtype)``, i.e. the weights dequantized by pagedserve, with HF names and
  the q/k rows already in HF order (no lm_head.weight when the embeddings are tied);
* tokenizer.json / tokenizer_config.json (chat template included): pagedserve's GGUF tokenizer,
  ``save_pretrained``;
* generation_config.json: bos/eos/pad ids from the config.

``--verify`` then checks, in float32, that transformers' greedy output on the folder equals pagedserve's on the
folder and on the original GGUF for a few chat prompts.
"""

from __future__ import annotations

import argparse
import os

import torch

from pagedserve.loader.model_loader import default_model_path, open_checkpoint

DEFAULT_OUT = "/work/engines/smollm2-hf"
VERIFY_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


def export(model: str, out: str, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    checkpoint = open_checkpoint(model)
    config = checkpoint.config
    config.dtype = dtype  # torch_dtype in older transformers
    os.makedirs(out, exist_ok=True)
    weights = {name: tensor.contiguous() for name, tensor in checkpoint.iter_weights(dtype)}
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    checkpoint.tokenizer().save_pretrained(out)
    print(f"wrote {out}: {len(weights)} tensors ({dtype}), {config.architectures[0]}, "
          f"tie_word_embeddings={config.tie_word_embeddings}")


def verify(model: str, out: str, max_tokens: int) -> bool:
    """Greedy float32 token ids: transformers on the folder vs pagedserve on the folder and on the GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(out)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for p in VERIFY_PROMPTS]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_ids = []
    for ids in prompts:
        with torch.no_grad():
            result = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
        hf_ids.append(result[0, len(ids):].tolist())
    del hf
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    ok = True
    for label, source in (("folder", out), ("gguf", model)):
        llm = LLM(model=source, dtype="float32")
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        for i, o in enumerate(outputs):
            same = list(o.outputs[0].token_ids) == hf_ids[i]
            ok &= same
            print(f"pagedserve({label}) vs transformers, prompt {i}: {'same' if same else 'DIFFERENT'}: "
                  f"{o.outputs[0].text!r}")
        del llm
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: pagedserve's default model)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="dtype of the saved weights (default bfloat16)")
    parser.add_argument("--verify", action="store_true",
                        help="compare greedy outputs of transformers and pagedserve (float32) after exporting")
    parser.add_argument("--verify-tokens", type=int, default=32, help="tokens generated per prompt by --verify")
    args = parser.parse_args()
    model = args.model or default_model_path()
    export(model, args.out, getattr(torch, args.dtype))
    if args.verify and not verify(model, args.out, args.verify_tokens):
        raise SystemExit("verification failed: greedy outputs differ")


if __name__ == "__main__":
    main()
