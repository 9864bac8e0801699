"""parity in one file: GRPO with a bf16 engine and an fp32 trainer, and every clip attributed.

    python examples/minimal_grpo.py --model DIR --prompts prompts.jsonl --eps 0.004

DIR is any Hugging Face causal LM directory (parity's testbed models: `parity testbed build
text-xs`, then $PARITY_CACHE/models/text-xs, by default ~/.cache/parity/models/text-xs).
prompts.jsonl holds one {"prompt": "..."} per line; the `neg-length` task's own prompts:

    python -c "import json; from parity.tasks.data import text_prompts
    print(*(json.dumps({'prompt': p}) for p in text_prompts(256)), sep='\\n')"

The task is `neg-length`: reward = −(completion tokens), so the best policy ends at once. The
defaults are `parity train`'s for it (parity/config/run.py); their 30 steps of text-xs take half a
minute with --threads 1 on a 2-core CPU. Each step prints one JSON object under `parity
train`'s metric names (docs/design.md, "Metrics"), to diff against a run's metrics.jsonl:
`parity train --model text-xs --eps-low 0.004 --eps-high 0.004 --device cpu` samples the same
tokens and logs the same figures (tests/test_minimal_grpo.py), given the same --threads on
both sides. The notation (docs/design.md):

    ℓ_μ  engine log-prob: recorded while sampling, engine precision (bf16), KV-cache decoding
    ℓ_π  trainer log-prob: fp32, with gradient
    ℓ_s  shadow log-prob: the trainer's current weights in engine precision, no gradient
    log r = ℓ_π − ℓ_μ = α + β,   α = ℓ_s − ℓ_μ (policy change),   β = ℓ_π − ℓ_s (precision gap)

A token is clipped when C(α + β, A) holds, phantom-clipped when C(α + β, A) but not C(α, A):
its gradient was zeroed by numerics alone, not by a policy that moved. Hidden is the reverse:
the trust region would clip the token, and the numerics let it through.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import itertools
import json
import math
import random

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--model", required=True, help="a Hugging Face causal LM directory")
p.add_argument("--prompts", required=True, help='JSONL, one {"prompt": "..."} per line')
p.add_argument("--steps", type=int, default=30)
p.add_argument("--prompts-per-step", type=int, default=8)
p.add_argument("--samples-per-prompt", type=int, default=8, help="G, the GRPO group size")
p.add_argument("--max-new-tokens", type=int, default=24, help="EOS included")
p.add_argument("--lr", type=float, default=3e-4)
p.add_argument("--max-grad-norm", type=float, default=1.0)
p.add_argument("--eps", type=float, default=0.2, help="sets both --eps-low and --eps-high")
p.add_argument("--eps-low", type=float)
p.add_argument("--eps-high", type=float)
p.add_argument("--epochs", type=int, default=1,
               help="updates per step, each on all of the step's completions")
p.add_argument("--temperature", type=float, default=1.0)
p.add_argument("--top-p", type=float, default=1.0)
p.add_argument("--top-k", type=int, default=0)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
args = p.parse_args()
eps_low = args.eps if args.eps_low is None else args.eps_low
eps_high = args.eps if args.eps_high is None else args.eps_high
if args.threads:
    torch.set_num_threads(args.threads)
G = args.samples_per_prompt

# ---- the models: fp32 master weights, and two engine-precision (bf16) copies of them: the
# engine's keeps the weights it sampled with, the shadow's takes the trainer's at each update
tok = AutoTokenizer.from_pretrained(args.model)
policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
# a chat model ends its turn with the generation config's own EOS besides the tokenizer's
gen_eos = getattr(policy.generation_config, "eos_token_id", None)
eos_ids = torch.tensor(sorted({tok.eos_token_id, *([gen_eos] if isinstance(gen_eos, int)
                                                     else gen_eos or [])}))
policy.train()
for m in policy.modules():  # no dropout in a forward that enters a ratio: β would measure it
    if isinstance(m, torch.nn.Dropout):
        m.p = 0.0
    if isinstance(getattr(m, "attention_dropout", None), float):
        m.attention_dropout = 0.0


def low_precision_copy(model):
    # Eager attention, as parity's engine attention computes it (QKᵀ and ·V in bf16, softmax in
    # fp32): the engine and the shadow share kernels, so that α at θ = θ_old is ~0, not a kernel
    # gap as large as β. With grouped-query heads eager repeats the keys where parity reshapes
    # the queries: the same sums in products of other shapes, which may round apart.
    low = copy.deepcopy(model).to(torch.bfloat16).eval().requires_grad_(False)
    low.set_attn_implementation("eager")
    # RoPE's inverse frequencies stay fp32, as in a model transformers or vLLM loads in bf16:
    # rounded to bf16, the angles drift along the sequence.
    for mine, theirs in zip(low.modules(), model.modules()):
        if isinstance(getattr(theirs, "inv_freq", None), torch.Tensor):
            mine.inv_freq = theirs.inv_freq.clone()
    return low


engine, shadow = low_precision_copy(policy), low_precision_copy(policy)
opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
# transformers 5.24 renamed the forward's `past_key_values` to `cache`
cache_kw = "cache" if "cache" in inspect.signature(engine.forward).parameters else "past_key_values"


def positions(mask):
    """Position ids that skip left padding: a padded prompt sees the positions it has alone."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def processed(logits, keep=None):
    """fp32 logits of the sampling distribution: temperature, top-k, top-p (removed: -inf).
    `keep`, the sampled tokens, is never removed: the trainer must not score a token the engine
    really drew as impossible because its own logits put it a hair outside the nucleus."""
    x = logits.float() / args.temperature
    remove = torch.zeros_like(x, dtype=torch.bool)
    if 0 < args.top_k < x.shape[-1]:
        remove |= x < torch.topk(x, args.top_k, dim=-1).values[..., -1:]
    if args.top_p < 1.0:
        sorted_x, order = torch.sort(x.masked_fill(remove, -math.inf), dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        remove |= torch.zeros_like(remove).scatter(-1, order, mass_before >= args.top_p)
    if keep is not None:
        remove.scatter_(-1, keep.unsqueeze(-1), False)
    return x.masked_fill(remove, -math.inf)


def cast_into(low, master):
    """The fp32 master weights rounded (to nearest) into a low-precision copy."""
    src = master.state_dict()
    with torch.no_grad():
        for name, t in low.state_dict().items():
            t.copy_(src[name].to(t.dtype))


# ---- the engine: batched KV-cache sampling in bf16, recording ℓ_μ ------------------------------
@torch.no_grad()
def sample(prompts, gen):
    """One completion per prompt, and its ℓ_μ. Prompts are left-padded, completions
    right-padded and ended by EOS when sampled. Each row draws one float64 uniform per position
    from `gen` (a CPU generator) and samples by inverse CDF, where torch.multinomial would draw
    a number per vocabulary entry: a seed samples the same tokens on any device."""
    B, P, N = len(prompts), max(map(len, prompts)), args.max_new_tokens
    ids, mask = torch.full((B, P), pad_id), torch.zeros((B, P), dtype=torch.long)
    for i, q in enumerate(prompts):
        ids[i, P - len(q):], mask[i, P - len(q):] = torch.tensor(q), 1
    pos, cache = positions(mask), DynamicCache()
    u = torch.rand((B, 1), generator=gen, dtype=torch.float64)
    out = engine(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                 logits_to_keep=1, **{cache_kw: cache})
    tokens = torch.full((B, N), pad_id)
    logp_mu, valid = torch.zeros((B, N)), torch.zeros((B, N))
    done, attn, last = torch.zeros(B, dtype=torch.bool), mask, pos[:, -1:]
    for t in range(N):
        x = processed(out.logits[:, -1])
        logp = x - torch.logsumexp(x, -1, keepdim=True)  # μ, as sampled from: x − logsumexp(x)
        cdf = logp.double().exp().cumsum(-1)  # in float64: each token's share of [0, 1) is its μ
        tok_t = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
        tok_t = tok_t.clamp(max=logp.shape[-1] - 1)
        alive = ~done
        tokens[:, t] = torch.where(alive, tok_t, pad_id)
        logp_mu[:, t] = torch.where(alive, logp.gather(-1, tok_t[:, None]).squeeze(-1), 0.0)
        valid[:, t] = alive.float()
        done |= alive & torch.isin(tok_t, eos_ids)
        if bool(done.all()) or t == N - 1:
            break
        # finished rows decode pad tokens on, discarded: the batch keeps its shape
        u = torch.rand((B, 1), generator=gen, dtype=torch.float64)
        attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype)], dim=1)
        last = last + 1
        out = engine(input_ids=tokens[:, t:t + 1], attention_mask=attn, position_ids=last,
                     use_cache=True, **{cache_kw: cache})
    T = int(valid.sum(0).nonzero().max()) + 1
    return ids, mask, tokens[:, :T], valid[:, :T], logp_mu[:, :T]


def score(model, ids, mask, comp, comp_mask):
    """log p(y_t) of each completion token under the processed distribution: one full forward
    over prompt + completion (the trainer's ℓ_π, or, on the bf16 shadow, ℓ_s)."""
    x_ids, x_mask = torch.cat([ids, comp], 1), torch.cat([mask, comp_mask.long()], 1)
    T = comp.shape[1]
    # the logits at position t predict token t + 1: the first T of the last T + 1 positions'
    logits = model(input_ids=x_ids, attention_mask=x_mask, position_ids=positions(x_mask),
                   use_cache=False, logits_to_keep=T + 1).logits[:, :T]
    x = processed(logits, keep=comp)
    return (x.gather(-1, comp.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, -1)) * comp_mask


def clip(x, adv):
    """C(x, A): where PPO's min(r·A, clip(r)·A) takes the clipped branch (zero gradient)."""
    return ((adv > 0) & (x > math.log1p(eps_high))) | ((adv < 0) & (x < math.log1p(-eps_low)))


def data_order(n, seed):
    """Shuffled epochs over the prompt rows, one after another."""
    for epoch in itertools.count():
        order = list(range(n))
        random.Random(f"{seed}-{epoch}").shuffle(order)
        yield from order


with open(args.prompts) as f:
    rows = [json.loads(line)["prompt"] for line in f if line.strip()]
prompt_ids = [tok(q)["input_ids"] for q in rows]
order = data_order(len(rows), args.seed)
gen = torch.Generator().manual_seed(args.seed)  # the sampler's own stream, on the CPU

for step in range(1, args.steps + 1):
    # ---- rollout: sync the engine, sample G completions per prompt, reward them -------------
    cast_into(engine, policy)
    picked = [next(order) for _ in range(args.prompts_per_step)]
    ids, mask, comp, cmask, logp_mu = sample([prompt_ids[i] for i in picked for _ in range(G)], gen)
    valid = cmask > 0
    rewards = -cmask.sum(-1)                           # neg-length: R_i = −|y_i|, EOS counted
    R = rewards.view(-1, G).double()                   # one row per prompt's group
    # A_i = (R_i − mean_g R) / (std_g R + 1e-4), the unbiased std (GRPO, as TRL computes it)
    adv = ((R - R.mean(-1, keepdim=True)) / (R.std(-1, keepdim=True) + 1e-4)).view(-1).float()
    A = adv[:, None]
    seen = {k: [] for k in ("clipped", "phantom", "hidden", "alpha_clipped", "alpha", "beta")}
    losses = []
    for _ in range(args.epochs):
        # ---- one update: ℓ_π with gradient, ℓ_s on the same weights in bf16 -----------------
        logp_pi = score(policy, ids, mask, comp, cmask)
        cast_into(shadow, policy)
        with torch.no_grad():
            logp_s = score(shadow, ids, mask, comp, cmask)
        # log r = ℓ_π − ℓ_μ (the engine ratio source: β inside the clip); 0 on padding, before
        # exp, so padding cannot overflow into the gradient
        log_r = torch.where(valid, logp_pi - logp_mu, torch.zeros_like(logp_pi))
        r = torch.exp(log_r)
        # PPO-clip per token: −min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A)
        per_token = -torch.minimum(r * A, torch.clamp(r, 1 - eps_low, 1 + eps_high) * A)
        # seq-mean (GRPO): L = (1/B) Σ_i (1/|y_i|) Σ_t ℓ_it
        per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
        loss = (per_token.sum(-1) / cmask.sum(-1).clamp(min=1)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        # ---- the attribution: α, β, and every clip to numerics or to the policy -------------
        alpha = (logp_s - logp_mu) * cmask             # α = ℓ_s − ℓ_μ
        beta = (logp_pi.detach() - logp_s) * cmask     # β = ℓ_π − ℓ_s
        # C(α + β, A) on log r itself, what the loss clipped: α and β summed apart may round
        # a token across the boundary
        clipped = clip(log_r.detach(), A) & valid
        alpha_clipped = clip(alpha, A) & valid         # C(α, A): the trust region's own clip
        for k, v in (("clipped", clipped), ("phantom", clipped & ~alpha_clipped),
                     ("hidden", ~clipped & alpha_clipped), ("alpha_clipped", alpha_clipped),
                     ("alpha", alpha), ("beta", beta)):
            seen[k].append(v[valid])
    pooled = {k: torch.cat(v).double() for k, v in seen.items()}  # every update's tokens
    print(json.dumps({
        "step": step,
        "reward/mean": float(rewards.mean()),
        "completion/len_mean": float(cmask.sum()) / len(rewards),
        "clip/frac": float(pooled["clipped"].mean()),
        "clip/phantom_frac": float(pooled["phantom"].mean()),
        "clip/hidden_frac": float(pooled["hidden"].mean()),
        "clip/alpha_frac": float(pooled["alpha_clipped"].mean()),
        "mismatch/alpha_abs_mean": float(pooled["alpha"].abs().mean()),
        "mismatch/beta_mean": float(pooled["beta"].mean()),
        "mismatch/beta_abs_mean": float(pooled["beta"].abs().mean()),
        "loss/policy": sum(losses) / len(losses),
    }), flush=True)
