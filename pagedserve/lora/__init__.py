"""Multi-LoRA serving: PEFT adapters loaded next to one base model, several in the same batch.

- request.py      LoRARequest (vLLM's names): pure Python, what requests carry
- peft_config.py  adapter_config.json read and checked: what this engine can serve, refused otherwise
- adapter.py      the adapter's tensors read, checked against the model, scaled: LoRAAdapter
- targets.py      HF module names (q_proj ...) -> the model's fused linears and their output slices
- manager.py      LoRAManager: adapters held in memory (LRU, load generations), add / remove / list
- slots.py        SlotTable: which adapter each of max_loras slots holds (the scheduler's view, pure Python)
- layers.py       LinearLoRA: one linear's stacked slot weights and the per-row delta
- model_slots.py  ModelLoRASlots: every linear's LinearLoRA, filled from adapters when a step needs them
- mapping.py      LoRAMapping: a step's token rows -> slots (carried by the forward context)

Only LoRARequest is imported here, so that `from pagedserve import LoRARequest` stays free of torch.
"""

from pagedserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
