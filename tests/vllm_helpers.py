"""What the tests of the `vllm` engine share, on the CPU (test_vllm_real.py) and on a GPU
(test_gpu_vllm.py): the engine on a testbed model, and prompts for it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from parity.audit.locate import relative_errors
from parity.engines import EngineSpec, make_engine
from parity.logprobs import Sampling
from parity.models import trace as tr

TEXTS = ["the cat", "a man went", "in the", "she said", "it was", "we", "on a", "and then"]


def vllm_engine(model: torch.nn.Module, tok, model_dir) -> Iterator:
    """A bf16 vLLM engine synced to `model` (on `model`'s device), closed after the fixture."""
    eng = make_engine("vllm", EngineSpec(model, str(model_dir), "bf16", [tok.eos_token_id],
                                         tok.pad_token_id, 0, 64, 16))
    eng.sync(model)
    yield eng
    eng.close()


def moved_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model`, on its device, with its first layer's weights scaled by 1.5: weights
    that sample and score visibly differently."""
    moved = type(model)(model.config).to(next(model.parameters()).device)
    moved.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in moved.named_parameters():
            if "layers.0" in name:
                p.mul_(1.5)
    return moved


def steps(run) -> list[dict]:
    """A run's metrics.jsonl, timing aside: what two runs of the same steps must agree on."""
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "throughput/"))}
            for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def train(args: list[str], out) -> list[dict]:
    """`parity train ARGS --out OUT` in this process; its steps."""
    from parity.cli import main
    assert main(["train", *args, "--out", str(out)]) == 0
    return steps(out)


def resume(run, steps_to: int) -> list[dict]:
    from parity.cli import main
    assert main(["train", "--resume", str(run), "--steps", str(steps_to), "--no-progress"]) == 0
    return steps(run)


def prompts_of(tok, n: int = 8) -> list[list[int]]:
    return [tok(t)["input_ids"] for t in TEXTS[:n]]


def row_seed(generator_seed: int, row: int, rows: int) -> int:
    """The vLLM seed the engine gives `row` of a batch of `rows` sampled from a generator
    seeded `generator_seed` (parity/engines/vllm.py)."""
    from parity.engines.vllm import row_seeds
    base = int(torch.randint(0, 2**31 - 1, (1,),
                             generator=torch.Generator().manual_seed(generator_seed)))
    return row_seeds(base, list(range(rows)))[row]


def whole_distribution(engine, prompt: list[int], s, seed: int, max_new_tokens: int,
                       eos: int) -> tuple[list[int], torch.Tensor]:
    """One row sampled by the engine's vLLM asking for every token's log-prob (`logprobs=-1`,
    vLLM's Python objects): its tokens and [n, V] log-probs, -inf where vLLM gave none."""
    from vllm import SamplingParams

    from parity.engines.vllm import sampling_kwargs
    kw = dict(sampling_kwargs(s, max_new_tokens, [eos], seed), logprobs=-1)
    out = engine.llm.generate([{"prompt_token_ids": prompt}], [SamplingParams(**kw)],
                              use_tqdm=False)[0].outputs[0]
    ref = torch.full((len(out.logprobs), engine.vocab), float("-inf"))
    for t, step in enumerate(out.logprobs):
        ref[t, list(step)] = torch.tensor([v.logprob for v in step.values()])
    return list(out.token_ids), ref


# One op's weights nudged, and the first traced point that must move (parity/models/trace.py).
NUDGES = [("layers.1.mlp.down_proj", "layers.1.mlp"),
          ("layers.1.input_layernorm", "layers.1.input_norm"),
          ("layers.0.post_attention_layernorm", "layers.0.post_norm"),
          ("layers.0.self_attn.o_proj", "layers.0.attention"),
          # the parts of vLLM's fused projections: qkv_proj's k, gate_up_proj's up
          ("layers.0.self_attn.k_proj", "layers.0.k"), ("layers.1.mlp.up_proj", "layers.1.up")]


def trace_is_vllms_own(model: torch.nn.Module, tok, engine) -> None:
    """vLLM's trace holds every point of the trainer's, at its shape, and its logits are the
    ones vLLM scores the sequences with."""
    s = Sampling()
    r = engine.generate(prompts_of(tok)[:3], 8, s, torch.Generator().manual_seed(5))
    seqs = [p[m > 0].tolist() + c for p, m, c in zip(r.prompt_ids, r.prompt_mask,
                                                     r.completions())]
    traced = list(engine.trace(seqs))
    decoded = list(engine.trace_decode(seqs))
    scored = engine.score(model, r, s).cpu()
    for b, (t, d, ids) in enumerate(zip(traced, decoded, seqs)):
        ref = tr.trace(model, ids)
        # every point of the trainer's trace, at its shape: prefill, and the decode step's row
        assert sorted(t, key=str) == sorted(ref, key=str), set(ref) ^ set(t)
        assert all(t[p].shape == ref[p].shape for p in ref)
        assert sorted(d, key=str) == sorted(ref, key=str), set(ref) ^ set(d)
        assert all(d[p].shape == (1, ref[p].shape[1]) for p in ref)
        n = int(r.completion_mask[b].sum())
        P = len(ids) - len(r.completions()[b])
        logp = torch.log_softmax(t["logits"][P - 1:P - 1 + n].cpu(), -1)
        mine = logp.gather(-1, torch.tensor(ids[P:P + n])[:, None]).squeeze(-1)
        assert (mine - scored[b, :n]).abs().max() < 1e-5


def nudged_op_is_named(model: torch.nn.Module, engine, name: str, first: str) -> None:
    """vLLM's own trace with `name`'s weights scaled by 1.05 against it without: the first
    point that moves is `first`; the plain weights restored give the plain trace back."""
    seqs = [[5, 9, 14, 3, 27, 8, 11, 40, 2, 19]]
    plain = next(engine.trace(seqs))
    moved = type(model)(model.config).to(next(model.parameters()).device)
    moved.load_state_dict(model.state_dict())
    with torch.no_grad():
        dict(moved.named_parameters())[f"model.{name}.weight"].mul_(1.05)
    try:
        engine.sync(moved)
        nudged = next(engine.trace(seqs))
    finally:
        engine.sync(model)
    errs = relative_errors(nudged, plain)
    points = tr.in_order(plain, tr.layer_count(model))
    moved_points = [p for p in points if errs[p].max() > 0]
    assert moved_points[0] == first, moved_points[:4]
    assert next(engine.trace(seqs))["logits"].equal(plain["logits"])
