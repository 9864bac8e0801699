"""A mixture of experts' routing gap on the MoE testbed model, and what measuring and replaying
it cost (docs/moe.md).

    python -m bench.moe                       # `moe`: 4 steps a run, 8 x 8 completions of 64
    python -m bench.moe --model moe-xs --steps 2 --json ''       # a quick look

Runs: `parity train` with a bf16 engine (parity's; `--engines hf,vllm` adds vLLM's) against an
fp32 trainer and a bf16 one, each without and with `--routing-replay`, on one seed: the first
step of a pair samples the same rollout, so its figures differ by what replay changes alone.
Tables:

- `gap`: per run, step 1 and the mean over the steps: the share of router decisions that
  flipped, of tokens with a flip, mean |β| on flipped and unflipped tokens, the phantom clips,
  k3 and the flipped tokens' share of it (under replay a deeper layer's own choice is made on
  the hidden states the replayed layers before it gave, so its flips differ from the free
  run's on the same rollout; layer 0's do not);
- `layers`: the flip share by MoE layer at step 1;
- `cost`: the engine's rollout with its routing recorded against the same rollout without, the
  trainer's forward and backward with the comparison's recording, and with replay, against the
  plain one (alternating, best of `--repeats`), and the record's bytes per 1,000 tokens;
- `training`: `--seeds` runs of `--train-steps` steps each, fp32 trainer, without and with
  replay: the reward, the length and the gap's figures, run by run, as they come out.

Absolute seconds drift on a shared machine; compare the rows of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.report import Table, engines_option, json_option, publish
from parity import metric_names as mn
from parity.models import routing

GAP = (mn.ROUTING_FLIP_FRAC, mn.ROUTING_TOKEN_FLIP_FRAC, mn.ROUTING_BETA_ABS_FLIPPED,
       mn.ROUTING_BETA_ABS_UNFLIPPED, mn.BETA_ABS_MEAN, mn.PHANTOM_FRAC, mn.KL_K3,
       mn.ROUTING_KL_K3_FLIPPED_SHARE)


def train_run(model: str, trainer: str, replay: bool, a: argparse.Namespace, out: Path,
              steps: int = 0, seed: int = 0, engine: str = "hf") -> list[dict[str, Any]]:
    from parity.cli import main
    code = main(["train", "--model", model, "--task", "neg-length", "--recipe", "bf16-engine",
                 "--engine", engine,
                 "--trainer-dtype", trainer, "--steps", str(steps or a.steps),
                 "--prompts-per-step", str(a.prompts), "--samples-per-prompt", str(a.samples),
                 "--max-new-tokens", str(a.tokens), "--seed", str(seed), "--no-progress",
                 "--out", str(out)] + (["--routing-replay"] if replay else []))
    if code:
        raise SystemExit(f"bench.moe: parity train exited {code} ({engine}, {trainer}, "
                         f"replay={replay})")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def _best(fns: dict[str, Any], repeats: int) -> dict[str, float]:
    """Each function's best time over `repeats` rounds, the functions alternating."""
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def costs(model_name: str, a: argparse.Namespace) -> Table:
    import dataclasses

    import transformers as tf

    from parity import testbed
    from parity.engines.hf import HFEngine
    from parity.logprobs import Sampling
    from parity.models.forward import score_full
    from parity.tasks.data import text_corpus

    path = testbed.resolve_model(model_name)
    tok = tf.AutoTokenizer.from_pretrained(path)
    master = tf.AutoModelForCausalLM.from_pretrained(path).float()
    engine = HFEngine(master, "bf16", tok.eos_token_id, tok.pad_token_id)
    paras = text_corpus(0)[:a.prompts * a.samples]
    prompts = [tok.encode(" ".join(p.split()[:8])) for p in paras]
    s = Sampling()
    gen = lambda: engine.generate(prompts, a.tokens, s, torch.Generator().manual_seed(0))
    r = gen()

    def update(replay: bool, record: bool) -> None:
        piece = r if replay else dataclasses.replace(r, routed=None)
        with (routing.recording(master) if record else contextlib.nullcontext()):
            logp = score_full(master, piece, s).logp
        (logp * r.completion_mask).sum().backward()
        master.zero_grad(set_to_none=True)

    def plain_rollout() -> None:
        with routing.off(engine.model):
            gen()

    t = _best({"rollout": plain_rollout, "rollout, recorded": gen,
               "update": lambda: update(False, False),
               "update, recorded": lambda: update(False, True),
               "update, replayed": lambda: update(True, False)}, a.repeats)
    L, E, k = routing.shape(master)
    per_1000 = 1000 * L * k * torch.tensor([], dtype=routing.id_dtype(E)).element_size()
    tab = Table("cost", f"{model_name}: what the routing costs ({len(prompts)} completions of up "
                f"to {a.tokens} tokens; best of {a.repeats}, alternating)",
                [("what", None), ("s", "{:.3f}"), ("against", None), ("s ", "{:.3f}"),
                 ("added", "{:+.1%}")])
    for what, base in (("rollout, recorded", "rollout"), ("update, recorded", "update"),
                       ("update, replayed", "update")):
        tab.add(what, t[what], base, t[base], t[what] / t[base] - 1)
    tab.notes.append(f"the record: {L} MoE layers x top-{k} of {E} experts, "
                     f"{routing.id_dtype(E)}: {per_1000 / 1024:.1f} KiB per 1,000 tokens")
    return tab


TRAINING = (mn.ROUTING_TOKEN_FLIP_FRAC, mn.ROUTING_BETA_ABS_FLIPPED, mn.BETA_ABS_MEAN,
            mn.PHANTOM_FRAC, mn.KL_K3)


def training(a: argparse.Namespace, out: Path) -> Table:
    """fp32 trainer, bf16 engine, without and with replay, `--seeds` seeds of
    `--train-steps` steps: what training does, run by run."""
    tab = Table("training", f"{a.model}: neg-length, bf16 engine against an fp32 trainer, "
                f"{a.train_steps} steps a run; reward and length over the last 5 steps, the "
                f"rest means over all steps",
                [("seed", None), ("replay", None), ("reward step 1", "{:.2f}"),
                 ("reward last 5", "{:.2f}"), ("length last 5", "{:.1f}")]
                + [(k.split("/", 1)[1], "{:.4g}") for k in TRAINING])
    for seed in range(a.seeds):
        for replay in (False, True):
            rows = train_run(a.model, "fp32", replay, a, out / f"train-s{seed}-{int(replay)}",
                             a.train_steps, seed)
            tail = rows[-5:]
            tab.add(seed, replay, rows[0][mn.REWARD_MEAN], _mean(tail, mn.REWARD_MEAN),
                    _mean(tail, mn.LEN_MEAN), *(_mean(rows, k) for k in TRAINING))
    return tab


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moe")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seeds", type=int, default=3, help="training runs a setting (0: none)")
    ap.add_argument("--train-steps", type=int, default=30)
    engines_option(ap)
    ap.add_argument("--out", default=None, help="keep the runs here")
    json_option(ap, "moe")
    a = ap.parse_args(argv)
    out = Path(a.out or tempfile.mkdtemp(prefix="bench-moe-"))
    engines = a.engines
    gap = Table("gap", f"{a.model}: bf16 engine against the trainer, without and with replay; "
                f"step 1 / mean of {a.steps} steps",
                [("engine", None), ("trainer", None), ("replay", None), ("step", None)]
                + [(k.split("/", 1)[1], "{:.4g}") for k in GAP])
    layers = None
    for engine in engines:
        for trainer in ("fp32", "bf16"):
            for replay in (False, True):
                name = f"{engine}-{trainer}-{'r3' if replay else 'free'}"
                rows = train_run(a.model, trainer, replay, a, out / name, engine=engine)
                if layers is None:
                    n = sum(k.startswith("routing/flip_frac_layer/") for k in rows[0])
                    layers = Table("layers", f"{a.model}: flip share by MoE layer, step 1",
                                   [("engine", None), ("trainer", None), ("replay", None)]
                                   + [(f"layer {j}", "{:.2%}") for j in range(n)])
                layers.add(engine, trainer, replay,
                           *(rows[0].get(mn.ROUTING_FLIP_FRAC_LAYER.format(layer=j))
                             for j in range(len(layers.columns) - 3)))
                gap.add(engine, trainer, replay, "1", *(rows[0].get(k) for k in GAP))
                gap.add(engine, trainer, replay, "mean", *(_mean(rows, k) for k in GAP))
    tables = [gap, layers, costs(a.model, a)]
    if a.seeds:
        tables.append(training(a, out))
    publish("moe", tables, a)


if __name__ == "__main__":
    main()
