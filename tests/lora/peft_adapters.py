"""LoRA adapters of the tiny test models, made with peft in the test run (random, non-zero weights), and
peft's own forward pass on them as the reference."""

from __future__ import annotations

import json
import os
import random

import torch

from pagedserve.lora.targets import LoRAShapes

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GREEDY_MAX_TOKENS = 12
TINY = LoRAShapes(2, {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
                      "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)})
"""The LoRA shapes of tests/conftest.py's tiny Llama: hidden 64, 4 heads of 16 (2 KV heads), MLP 128, 2 layers."""


def make_adapter(base_dir: str, out_dir: str, seed: int, modules=("q_proj", "v_proj"), rank: int = 4,
                 alpha: float = None, **extra) -> str:
    """Save a peft LoRA adapter of the model in `base_dir`. init_lora_weights=False makes B non-zero, so the
    adapter changes the outputs (a silent fallback to the base model would show)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank if alpha is None else alpha, target_modules=list(modules),
                        init_lora_weights=False, **extra)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # peft's random init is small; make the adapters change the greedy tokens for sure
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    peft_model.save_pretrained(out_dir)
    return out_dir


def edit_config(adapter_dir: str, **changes) -> str:
    """Change keys of adapter_config.json in place (for adapters peft would not write)."""
    path = os.path.join(adapter_dir, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return adapter_dir


def peft_reference(base_dir: str, adapter_dir, prompt: list[int], max_tokens: int = GREEDY_MAX_TOKENS,
                   top: int = 5):
    """peft's greedy tokens for the prompt, and the top-`top` (token, logprob) pairs at every generated
    position; adapter_dir None is the base model without peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        tokens = out[0, len(prompt):].tolist()
        logits = model(input_ids=out[:, :-1]).logits[0, len(prompt) - 1:].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    values, ids = logprobs.topk(top, dim=-1)
    return tokens, [list(zip(i.tolist(), v.tolist())) for i, v in zip(ids, values)]


def random_prompt(seed: int, length: int, vocab: int = 390) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]
