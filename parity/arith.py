"""The arith task's problems, answers, grading and solve-rate estimate.

testbed.py trains the arith models on `problem`'s stream; tasks.py keeps the problems a model
solves part of the time (by `solve_rates`) and rewards completions with `correct`. Neither the
training data nor the reward can drift from the other while both come from here.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable


def problem(rng: random.Random) -> tuple[str, str]:
    """One addition problem of two 1-3 digit numbers and its answer, e.g. ("37+58=", "95").

    Digit counts are drawn first so short operands are as common as long ones: a briefly trained
    model gets short sums right and struggles with 3-digit carries, which gives the arith task
    its band of partially solved problems.
    """
    a = rng.randrange(10 ** rng.randint(1, 3))
    b = rng.randrange(10 ** rng.randint(1, 3))
    return f"{a}+{b}=", str(a + b)


def correct(completion: str, answer: str) -> bool:
    """The completion text, EOS removed, is the answer."""
    return completion.strip() == answer


def solve_rates(model_or_dir, problems: list[tuple[str, str]], samples: int = 40,
                temperature: float = 1.0, tok=None, seed: int = 0, batch: int | None = None,
                prompt_ids: list[list[int]] | None = None,
                on_batch: Callable[[int, int, int], None] | None = None) -> list[float]:
    """Fraction of `samples` completions that solve each problem, sampled with parity's own
    engine in fp32 (temperature 0 = greedy), exactly as the arith task then samples them.

    prompt_ids: the prompts as the task will feed them (a chat template applied); default the
        plain problem text.
    batch: completions sampled together; default as many as keep one step's fp32 logits near
        256 MB (4096 on the testbed's character vocabulary).
    on_batch(done, total, solved): called after each batch with completions sampled so far and
        how many were right; it may raise to stop early.
    """
    # torch and the engine load here, not at import: the testbed's listing and cache helpers
    # import this module and must stay cheap.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from parity.engines import Sampling
    from parity.engines.hf import HFEngine

    model = model_or_dir
    if isinstance(model_or_dir, (str, Path)):
        model = AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(model_or_dir)
    if batch is None:
        batch = max(samples, min(4096, 2 ** 26 // model.config.vocab_size))
    engine = HFEngine(model, "fp32", tok.eos_token_id, tok.pad_token_id)
    s = Sampling(temperature) if temperature > 0 else Sampling(1.0, top_k=1)
    g = torch.Generator().manual_seed(seed)
    prompt_ids = prompt_ids or [tok(p)["input_ids"] for p, _ in problems]
    ids = [p for p in prompt_ids for _ in range(samples)]
    right: list[bool] = []
    for i in range(0, len(ids), batch):
        r = engine.generate(ids[i: i + batch], 8, s, g)
        texts = tok.batch_decode(r.completions(), skip_special_tokens=True)
        right += [correct(t, problems[(i + k) // samples][1]) for k, t in enumerate(texts)]
        if on_batch is not None:
            on_batch(len(right), len(ids), sum(right))
    return [sum(right[j * samples:(j + 1) * samples]) / samples for j in range(len(problems))]
