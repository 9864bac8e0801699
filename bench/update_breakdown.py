"""Where the time of one parity training update goes on a real model, part by part, with MFU.

    python -m bench.update_breakdown                       # smollm2-135m, 64 x <= 64 tokens
    python -m bench.update_breakdown --model text --rows 16 --tokens 32 --reps 1

The completions are sampled once by parity's engine (the default recipe's bf16 engine, plain
neg-length prompts as bench/micro_batch_time.py takes them), recording the engine's whole
distribution for the `kl_exact_rows` rows the trainer would pick. Each rep then runs
`parity.trainer.update` itself, once over the whole minibatch and once with `--micro-batch`
pieces, alternated so drift of a shared machine hits both, plus the `recompute` recipe's θ_old
forward (`parity.trainer.prepare`). Nothing is re-implemented: the trainer's own functions are
wrapped with timers (the names `update` looks up, the scaler's and the shadow's methods, the
optimizer's step hooks), and forward hooks on the trunk (`model.model`) and the LM head split the
forward; a gradient hook on the trunk's output splits the backward into the log-softmax + head
part and the trunk part.

FLOPs are counted as bench/mfu.py counts them, over the tokens the model needs (each row's
prompt + completion, padding excluded): 2 per matrix-product weight per token, attention
4 · layers · width · context, backward 2x the forward. The LM head is counted on the completion
positions only, the trunk on every position. MFU is against the best square matrix product
(fp32, or bf16 for the shadow) measured just before each rep in this process. Parts that are
not matrix products (log-softmax, AdamW, the exact KL) get no MFU.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
from mfu import attn_flops, matmul_params, matmul_rate  # bench/ is the script's own directory

import parity.diagnostics as diagnostics
import parity.models.precision as precision
import parity.trainer as trainer
from bench.report import Table, json_option, publish
from parity import testbed
from parity.config import Config
from parity.diagnostics import Shadow, exact_kl_rows
from parity.engines import stop_token_ids
from parity.engines.hf import HFEngine
from parity.logprobs import Rollout, Sampling
from parity.models.forward import disable_dropout
from parity.models.loading import load_policy
from parity.models.precision import LossScaler
from parity.objectives import OBJECTIVES
from parity.runs.distributed import Dist
from parity.tasks.data import text_prompts


class Clock:
    """Seconds per named part of the call running now. `phase` prefixes what the model hooks
    see, so the same trunk and head are told apart in the trainer's forward, the recompute and
    the shadow."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.phase = "fwd"
        self.open: dict[str, float] = {}
        self.bwd_start = 0.0

    def wrap(self, name: str, fn, phase: str | None = None):
        def timed(*args, **kwargs):
            before, t = self.phase, time.perf_counter()
            if phase:
                self.phase = phase
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc[name] += time.perf_counter() - t
                self.phase = before
        return timed

    def hook(self, module: torch.nn.Module, part: str, grad_split: bool = False) -> None:
        def pre(_m, _args, _kwargs=None):
            self.open[part] = time.perf_counter()

        def post(_m, _args, out):
            self.acc[f"{self.phase}.{part}"] += time.perf_counter() - self.open.pop(part)
            h = getattr(out, "last_hidden_state", None)
            if grad_split and h is not None and h.requires_grad:
                # fires once the gradient has come back through the log-softmax and the head
                h.register_hook(self._head_backward_done)
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    def _head_backward_done(self, grad: torch.Tensor) -> None:
        self.acc["bwd.head"] += time.perf_counter() - self.bwd_start

    def backward(self, fn):
        def timed(loss):
            self.bwd_start = time.perf_counter()
            fn(loss)
            self.acc["bwd"] += time.perf_counter() - self.bwd_start
        return timed

    def take(self) -> defaultdict[str, float]:
        out, self.acc = self.acc, defaultdict(float)
        return out


class PeakRSS:
    """Peak resident memory above the level at `start`, polled every 5 ms: the vocabulary-wide
    tensors are far above glibc's mmap threshold, so they are returned to the system when freed
    and each update's peak is its own."""

    def __init__(self) -> None:
        self.page = 4096
        self.peak = self.base = 0
        self.running = False

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _poll(self) -> None:
        while self.running:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.005)

    def __enter__(self) -> "PeakRSS":
        self.base = self.peak = self._rss()
        self.running = True
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()

    @property
    def growth(self) -> float:
        return (self.peak - self.base) / 1e9


def make_run(cfg: Config, model, tok, shadow, opt, params, s: Sampling) -> trainer.Run:
    """The parts of a `trainer.Run` that `update` and `prepare` use, built as `build_run`
    builds them for one process (no run directory, engine or rollout queue)."""
    return trainer.Run(cfg=cfg, dist=Dist(), dir=Path("."), objective=OBJECTIVES[cfg.objective],
                       model=model, policy=model, tok=tok, task=None, engine=None, shadow=shadow,
                       value_head=None, value=None, ref_model=None,
                       scaler=LossScaler(cfg.trainer_dtype, torch.device("cpu"),
                                         cfg.loss_scale_init, cfg.loss_scale_growth_interval),
                       opt=opt, params=params, rollouts=None, sampling=s,
                       device=torch.device("cpu"), first_step=1, fsdp=False)


def instrument(clock: Clock, model, shadow: Shadow, opt, runs: list[trainer.Run]) -> None:
    """Timers on the names the trainer's functions look up when they run."""
    trainer.score_full = clock.wrap("fwd", trainer.score_full)
    trainer.exact_kl_of_rows = clock.wrap("kl", trainer.exact_kl_of_rows)
    diagnostics.cast_weights_into = clock.wrap("shadow.cast", diagnostics.cast_weights_into)
    precision.all_finite = clock.wrap("opt.finite", precision.all_finite)
    torch.nn.utils.clip_grad_norm_ = clock.wrap("opt.clip", torch.nn.utils.clip_grad_norm_)
    shadow.logprobs = clock.wrap("shadow", shadow.logprobs, phase="shadow")
    for r in runs:
        r.scaler.backward = clock.backward(r.scaler.backward)
        r.scaler.step = clock.wrap("opt", r.scaler.step)
    opt.register_step_pre_hook(lambda *_: clock.open.__setitem__("adamw", time.perf_counter()))
    opt.register_step_post_hook(lambda *_: clock.acc.__setitem__(
        "opt.adamw", clock.acc["opt.adamw"] + time.perf_counter() - clock.open.pop("adamw")))
    for m in (model, shadow.model):
        if m is not None:
            clock.hook(m.model, "trunk", grad_split=m is model)
            clock.hook(m.get_output_embeddings(), "head")


def flops(model, r: Rollout) -> dict[str, float]:
    """Forward FLOPs of the trunk (every real position) and of the LM head (the completion
    positions), as bench/mfu.py counts them."""
    plen, clen = r.prompt_mask.sum(-1).long(), r.completion_mask.sum(-1).long()
    head = model.get_output_embeddings().weight
    n_trunk = matmul_params(model) - head.numel()
    trunk = sum(2 * n_trunk * c + sum(attn_flops(model, j) for j in range(1, c + 1))
                for c in (plen + clen).tolist())
    return {"trunk": trunk, "head": 2 * head.numel() * float(clen.sum())}


# (label, how to get its seconds from a rep's clock, FLOPs key, reference rate)
PARTS = [
    ("forward with grad: trunk", lambda a: a["fwd.trunk"], "trunk", "fp32"),
    ("forward with grad: LM head", lambda a: a["fwd.head"], "head", "fp32"),
    ("log-softmax + gather of the sampled tokens", lambda a: a["fwd"] - a["fwd.trunk"]
     - a["fwd.head"], None, None),
    ("backward: log-softmax + LM head", lambda a: a["bwd.head"], "head2", "fp32"),
    ("backward: trunk", lambda a: a["bwd"] - a["bwd.head"], "trunk2", "fp32"),
    ("loss, α/β attribution, metrics (rest of `update`)", lambda a: a["update"] - a["fwd"]
     - a["bwd"] - a["opt"] - a["shadow"] - a["kl"], None, None),
    ("grad-norm clip", lambda a: a["opt.clip"], None, None),
    ("AdamW step", lambda a: a["opt.adamw"], None, None),
    ("finite check + zero_grad", lambda a: a["opt"] - a["opt.clip"] - a["opt.adamw"], None,
     None),
    ("shadow: cast weights to bf16", lambda a: a["shadow.cast"], None, None),
    ("shadow forward, bf16, no grad", lambda a: a["shadow"] - a["shadow.cast"], "fwd",
     "bf16"),
    ("exact KL(μ‖π) over the vocabulary", lambda a: a["kl"], None, None),
]


def logits_gb(r: Rollout, vocab: int, micro: int) -> tuple[float, float]:
    """One fp32 [rows, positions, V] tensor of the head's output (T + 1 positions kept), for the
    whole minibatch and for the largest micro-batch (trimmed to its longest completion)."""
    B, T = r.completion_ids.shape
    clen = r.completion_mask.sum(-1).long().tolist()
    piece = max(len(clen[a:a + micro]) * (max(clen[a:a + micro]) + 1) for a in range(0, B, micro))
    return B * (T + 1) * vocab * 4 / 1e9, piece * vocab * 4 / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=64, help="completions in the minibatch")
    ap.add_argument("--tokens", type=int, default=64, help="max tokens per completion")
    ap.add_argument("--micro-batch", type=int, default=8, help="completions per micro-batch")
    ap.add_argument("--reps", type=int, default=2)
    a = json_option(ap, "update_breakdown").parse_args()

    t_start = time.perf_counter()
    model, tok = load_policy(testbed.resolve_model(a.model))
    # the default recipe as `parity train` runs it; one prompt group per step is all one update
    cfg = Config(model=a.model, prompts_per_step=1, samples_per_prompt=a.rows, lr=1e-6).validate()
    s = Sampling(cfg.temperature, cfg.top_p, cfg.top_k)
    prompts = [tok(p)["input_ids"] for p in text_prompts(a.rows, seed=0)]
    kl_rows = exact_kl_rows(a.rows, cfg.kl_exact_rows)
    engine = HFEngine(model, cfg.engine_dtype, stop_token_ids(model, tok), tok.pad_token_id)
    r = engine.generate(prompts, a.tokens, s, torch.Generator().manual_seed(0), record_rows=kl_rows)
    del engine
    rewards = -r.completion_mask.sum(-1)  # neg-length's reward; it only moves the clip fractions

    model.train()
    disable_dropout(model)
    shadow = Shadow(model, cfg.engine_dtype, cfg.trainer_dtype, cfg.cpu_fp16, cfg.lm_head_fp32,
                    cfg.logprob_chunk, cfg.shadow_kernels)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = trainer.make_optimizer(cfg, params)
    sides = {"whole": cfg, f"micro{a.micro_batch}": replace(cfg, micro_batch=a.micro_batch)}
    runs = {k: make_run(c, model, tok, shadow, opt, params, s) for k, c in sides.items()}
    recompute = {k: make_run(replace(c, ratio_source="recompute"), model, tok, shadow, opt,
                             params, s) for k, c in sides.items()}
    clock = Clock()
    instrument(clock, model, shadow, opt, list(runs.values()) + list(recompute.values()))
    prep = trainer.prepare(runs["whole"], r, rewards)
    data = trainer.StepData(step=1, rollout=r, rewards=rewards, prep=prep, minibatch=a.rows)
    do_update = clock.wrap("update", trainer.update)
    do_prepare = clock.wrap("recompute", trainer.prepare, phase="recompute")

    def one(side: str) -> tuple[dict[str, float], float]:
        with PeakRSS() as mem:
            do_update(runs[side], data, 0, 0, trainer.Updates())
        do_prepare(recompute[side], r, rewards)
        return clock.take(), mem.growth

    # warm-up (AdamW's state, first-call kernels) on one micro-batch's rows: a whole extra
    # update would cost minutes on a shared machine
    head = r.select(slice(0, a.micro_batch))
    do_update(runs["whole"], trainer.StepData(step=1, rollout=head,
                                              rewards=rewards[:a.micro_batch],
                                              prep=trainer.Prepared(adv=prep.adv[:a.micro_batch]),
                                              minibatch=a.micro_batch),
              0, 0, trainer.Updates())
    clock.take()
    res: dict[str, list] = {k: [] for k in sides}
    rates: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for i in range(a.reps):
        rates["fp32"].append(max(matmul_rate(torch.float32, 2048) for _ in range(2)))
        rates["bf16"].append(max(matmul_rate(torch.bfloat16, 4096) for _ in range(2)))
        for side in (sides if i % 2 == 0 else reversed(list(sides))):
            res[side].append(one(side))
            print(f"rep {i + 1} {side}: update {res[side][-1][0]['update']:.1f} s", flush=True)

    fl = flops(model, r)
    fl.update(head2=2 * fl["head"], trunk2=2 * fl["trunk"], fwd=fl["trunk"] + fl["head"])
    rate = {k: statistics.median(v) for k, v in rates.items()}
    med = {side: {label: statistics.median(get(acc) for acc, _ in res[side])
                  for label, get, *_ in PARTS} for side in sides}
    tot = {side: statistics.median(acc["update"] for acc, _ in res[side]) for side in sides}
    rec = {side: statistics.median(acc["recompute"] for acc, _ in res[side]) for side in sides}
    mem = {side: statistics.median(g for _, g in res[side]) for side in sides}
    w, m = sides
    B, T = r.completion_ids.shape
    clen = r.completion_mask.sum(-1)
    t = Table("update_breakdown",
              f"{a.model}: {B} completions, mean {clen.mean():.1f} / max {T} tokens, prompts "
              f"{r.prompt_mask.sum(-1).float().mean():.1f} tokens on average, recipe {cfg.recipe} "
              f"(engine {cfg.engine_dtype}, trainer {cfg.trainer_dtype}), kl_exact_rows "
              f"{cfg.kl_exact_rows}, {torch.get_num_threads()} threads, median of {a.reps} reps; "
              f"matrix-product rate {rate['fp32'] / 1e9:.0f} GFLOP/s fp32, "
              f"{rate['bf16'] / 1e9:.0f} bf16",
              [("part", None), (f"{w} s", "{:.2f}"), ("share", "{:.1%}"), (f"{m} s", "{:.2f}"),
               ("share", "{:.1%}"), ("GFLOP", "{:.0f}"), (f"MFU {w}", "{:.0%}"),
               (f"MFU {m}", "{:.0%}")])

    def mfu(f: float, sec: float, ref: str | None) -> float | None:
        return f / sec / rate[ref] if ref and sec > 0 else None
    for label, _, key, ref in PARTS:
        tw, tm = med[w][label], med[m][label]
        t.add(label, tw, tw / tot[w], tm, tm / tot[m], fl[key] / 1e9 if key else None,
              mfu(fl[key], tw, ref) if key else None, mfu(fl[key], tm, ref) if key else None)
    train_f = 3 * fl["fwd"]
    t.add("**update**", tot[w], 1.0, tot[m], 1.0, (train_f + fl["fwd"]) / 1e9, None, None)
    t.add("θ_old recompute forward, no grad (`recompute` recipe only, on top of the update)",
          rec[w], rec[w] / tot[w], rec[m], rec[m] / tot[m], fl["fwd"] / 1e9,
          mfu(fl["fwd"], rec[w], "fp32"), mfu(fl["fwd"], rec[m], "fp32"))

    for side in sides:
        d = med[side]
        same = sum(d[lab] for lab, *_ in PARTS[:5]) + d["grad-norm clip"] + d["AdamW step"]
        extra = sum(d[lab] for lab, *_ in PARTS[9:])
        t.notes.append(f"{side}: forward + backward + clip + AdamW (what TRL does too) "
                       f"{100 * same / tot[side]:.1f}% of the update, at "
                       f"{100 * train_f / same / rate['fp32']:.0f}% MFU; shadow + exact KL "
                       f"(parity's diagnostics) {100 * extra / tot[side]:.1f}%")
    whole_gb, piece_gb = logits_gb(r, model.config.vocab_size, a.micro_batch)
    t.notes.append(f"logits, one fp32 [rows, T + 1, {model.config.vocab_size}] tensor: "
                   f"{whole_gb:.2f} GB whole, {piece_gb:.2f} GB for the largest micro-batch; "
                   f"peak RSS growth during the update (median): {w} {mem[w]:.2f} GB "
                   f"(= {mem[w] / whole_gb:.1f} such tensors), {m} {mem[m]:.2f} GB")
    t.notes.append(f"micro / whole update time: {tot[m] / tot[w]:.3f}; wall time of the command "
                   f"{time.perf_counter() - t_start:.0f} s")
    publish("update_breakdown", [t], a)

if __name__ == "__main__":
    main()
