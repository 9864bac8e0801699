"""The model a run trains, as parity loads and runs it.

    loading.py     a model directory loaded as an fp32 policy and its tokenizer, or refused
    forward.py     the trainer's forward: log-probs of a rollout's completion tokens (ℓ_π)
    attention.py   parity's attention, registered with transformers
    precision.py   dtypes, the trainer's autocast, loss scaling, weight casts
    lora.py        fp32 adapters on a frozen base
    pretrained.py  real pretrained models shipped inside Python packages
    sizes.py       bytes a dtype takes, vLLM's KV cache: from a model's config, without torch
"""
