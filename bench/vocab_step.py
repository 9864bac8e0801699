"""What parity's diagnostics cost at a real vocabulary: a training step on a narrow model with
Qwen3's 151,936 tokens and 256 new tokens, on each engine, with the default diagnostics, without
the exact KL, with none, and the engine's sampling alone; then the verl plugin's figures on the
driver against verl's own `compute_data_metrics`.

    python -m bench.vocab_step                        # parity's engine, 2 runs x 3 steps a setting
    python -m bench.vocab_step --engines hf,vllm --steps 4
    python -m bench.vocab_step --verl-only            # the driver figure alone
    python -m bench.vocab_step --engines hf,vllm --parts \
        --json docs/data/bench/vocab_step-parts.json  # the exact KL's parts, one process each

`qwen3-narrow-shape` (random weights, 2 layers of width 256) makes the per-vocabulary work a
real model's (sampling, log-probs, the exact KL over 151,936 entries a position) while its
layers cost little: the shares below are an upper bound on what the same diagnostics cost a
real model, whose layers take longer. A random model rarely samples EOS, so every completion
runs the full 256 tokens and the configurations decode the same amount. Each configuration is
its own run in a fresh process, `--rounds` of them alternating; each run's first step is
dropped (vLLM's start, allocator warm-up) and the others averaged. Shares are of the step
with the default diagnostics, against the same step measured in the same run of the bench.
Targets: every default diagnostic together at most 10% of the step, the exact KL at most 3%.

verl: one batch of `--verl-rows` x `--verl-tokens` as the driver holds it after
`compute_advantage`, timed through verl's own `compute_data_metrics` with and without the
plugin's figures (`parity.integrations.verl.step_figures`); target at most 1 s added, or no
more than verl's own time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

from bench.report import Table, engines_option, json_option, publish

MODEL = "qwen3-narrow-shape"
# (name, what differs from the defaults)
SETTINGS = (("default diagnostics", {}),
            ("kl_exact_rows 0", {"kl_exact_rows": 0}),
            ("diagnostics off", {"kl_exact_rows": 0, "diagnostics": False}))


def run_steps(engine: str, over: dict, a: argparse.Namespace) -> list[dict]:
    """The metrics of one run's steps after the first, the run in a fresh process: runs one after
    another in one process inherit the allocator's state the last one left, and on the CPU
    what it holds moves a step's time (docs/performance.md)."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(_run_steps, engine, over, a).result()


def _run_steps(engine: str, over: dict, a: argparse.Namespace) -> list[dict]:
    from parity.config import make_config
    from parity.trainer import train
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_config({"recipe": "bf16-engine", "task": "neg-length", "model": a.model,
                           "engine": engine, "steps": a.steps,
                           "prompts_per_step": a.prompts, "samples_per_prompt": a.group,
                           "max_new_tokens": a.max_new_tokens, "micro_batch": a.micro_batch,
                           "lr": 1e-6, "out": f"{tmp}/run", "progress": False, **over})
        run = train(cfg)
        return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][1:]


def step_table(a: argparse.Namespace) -> Table:
    from parity import testbed
    path = testbed.ensure(a.model)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    t = Table("vocab_step",
              f"a step at vocabulary {vocab:,}: {a.model}, neg-length {a.prompts}x{a.group}, "
              f"{a.max_new_tokens} new tokens, micro-batch {a.micro_batch}, mean of "
              f"{a.steps - 1} steps after the first, over {a.rounds} alternating runs of each "
              f"setting, each run in a fresh process",
              [("engine", None), ("setting", None), ("tokens a step", "{:.0f}"),
               ("rollout s", "{:.2f}"), ("train s", "{:.2f}"), ("step s", "{:.2f}"),
               ("share of the default step", "{:.1%}")])
    for engine in a.engines:
        rows: dict[str, list[dict]] = {name: [] for name, _ in SETTINGS}
        for _ in range(a.rounds):
            for name, over in SETTINGS:
                rows[name] += run_steps(engine, over, a)
        mean: dict[str, dict[str, float]] = {}
        for name, _ in SETTINGS:
            mean[name] = {k: statistics.mean(r[k] for r in rows[name]) for k in
                          ("time/rollout_s", "time/train_s", "time/step_s")}
            mean[name]["tokens"] = statistics.mean(
                r["completion/len_mean"] * a.prompts * a.group for r in rows[name])
        full = mean["default diagnostics"]["time/step_s"]
        off = mean["diagnostics off"]
        for name, _ in SETTINGS:
            m = mean[name]
            # what the settings below the defaults leave out, as a share of the default step
            share = (full - m["time/step_s"]) / full if name != "default diagnostics" else None
            t.add(engine, name, m["tokens"], m["time/rollout_s"], m["time/train_s"],
                  m["time/step_s"], share)
        t.add(engine, "sampling alone", off["tokens"], off["time/rollout_s"], None, None,
              off["time/rollout_s"] / full)
    t.notes.append("share: the default step's time less this setting's, over the default "
                   "step's: on the `kl_exact_rows 0` line the exact KL's cost, on `diagnostics "
                   "off` every default diagnostic's; on `sampling alone`, the engine's share")
    return t


def parts_table(a: argparse.Namespace) -> Table:
    """The exact KL's two parts, each timed in one process: the engine keeping the recorded
    rows (its rollout with and without them, alternating), and the update's sum over them
    (`exact_kl_of_rows` on the trainer's logits of those rows), after one untimed call."""
    import torch

    from parity import testbed
    from parity.config import Config
    from parity.diagnostics import exact_kl_of_rows, exact_kl_rows
    from parity.engines import EngineSpec, make_engine
    from parity.logprobs import Sampling
    from parity.models.forward import score_full
    from parity.models.loading import load_policy
    from parity.tasks import build_task
    path = testbed.ensure(a.model)
    model, tok = load_policy(path)
    task = build_task("neg-length", None, path, None, tok, a.max_new_tokens, None, 0, 1.0)
    rows = a.prompts * a.group
    prompts = [task.prompt_ids[i % a.prompts] for i in range(rows)]
    kept = exact_kl_rows(rows, Config.kl_exact_rows)   # parity's default
    s = Sampling()
    t = Table("vocab_step_parts",
              f"the exact KL's parts at vocabulary {model.config.vocab_size:,}: {rows} "
              f"completions of {a.max_new_tokens} tokens, {len(kept)} recorded, "
              f"{a.rounds} alternating rounds in one process (means)",
              [("engine", None), ("rollout s", "{:.2f}"), ("rollout s, rows recorded", "{:.2f}"),
               ("recording", "{:+.1%}"), ("exact KL sum s", "{:.2f}")])
    for name in a.engines:
        eng = make_engine(name, EngineSpec(model, str(path), "bf16", [tok.eos_token_id],
                                           tok.pad_token_id, 0,
                                           max(map(len, prompts)) + a.max_new_tokens, rows))
        eng.sync(model)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(a.rounds + 1):   # round 0 warms the engine up
            for record in (False, True):
                t0 = time.perf_counter()
                r = eng.generate(prompts, a.max_new_tokens, s,
                                 torch.Generator().manual_seed(i), kept if record else None)
                if i:
                    times[record].append(time.perf_counter() - t0)
        eng.close()
        with torch.no_grad():
            logits = score_full(model, r, s, keep_logits=kept).logits
            sums = []
            for i in range(a.rounds + 1):   # round 0: first-touch page faults of its buffers
                t0 = time.perf_counter()
                exact_kl_of_rows(r, logits, kept, r.completion_mask[kept], s)
                if i:
                    sums.append(time.perf_counter() - t0)
            kl_s = statistics.mean(sums)
        off, on = (statistics.mean(times[k]) for k in (False, True))
        t.add(name, off, on, (on - off) / off, kl_s)
    return t


def verl_table(a: argparse.Namespace) -> Table:
    import torch
    from verl import DataProto
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    from parity.integrations.verl import RunSettings, step_figures
    rows, T = a.verl_rows, a.verl_tokens
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(T // 8, T + 1, (rows,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -torch.rand(rows, T, generator=g) * 3 * mask
    mu = (old + 0.01 * torch.randn(rows, T, generator=g)) * mask
    adv = torch.randn(rows, 1, generator=g).expand(rows, T) * mask
    prompts = torch.randint(5, 50, (rows, 64), generator=g)
    responses = torch.randint(5, 50, (rows, T), generator=g)
    batch = DataProto.from_dict(tensors={
        "old_log_probs": old, "rollout_log_probs": mu, "response_mask": mask,
        "advantages": adv, "returns": adv.clone(), "token_level_scores": adv.clone(),
        "token_level_rewards": adv.clone(), "prompts": prompts, "responses": responses,
        "attention_mask": torch.cat([torch.ones(rows, 64), mask], 1).long(),
        "input_ids": torch.cat([prompts, responses], 1)})

    def timed(f) -> float:
        best = float("inf")
        for _ in range(a.verl_repeats):
            t0 = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t0)
        return best

    own = timed(lambda: compute_data_metrics(batch, use_critic=False))
    ours = timed(lambda: step_figures(batch, RunSettings()))
    t = Table("vocab_step_verl",
              f"verl's driver: one batch of {rows} x {T} tokens ({int(mask.sum()):,} valid), "
              f"best of {a.verl_repeats}",
              [("what", None), ("s", "{:.3f}"), ("against verl's own", "{:.2f}x")])
    t.add("verl's compute_data_metrics", own, 1.0)
    t.add("parity's figures (step_figures)", ours, ours / own)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--verl-rows", type=int, default=512)
    ap.add_argument("--verl-tokens", type=int, default=4096)
    ap.add_argument("--verl-repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs of each setting, alternating (--parts: rollouts with and "
                    "without the recorded rows)")
    ap.add_argument("--verl-only", action="store_true")
    ap.add_argument("--parts", action="store_true", help="only the exact KL's parts, each "
                    "timed in one process, and the verl figure")
    a = json_option(engines_option(ap), "vocab_step").parse_args()
    tables = [parts_table(a)] if a.parts else [] if a.verl_only else [step_table(a)]
    try:
        tables.append(verl_table(a))
    except ImportError as e:   # verl is optional (docs/verl.md)
        print(f"verl's driver figure not measured: {e}")
    publish("vocab_step", tables, a)


if __name__ == "__main__":
    main()
