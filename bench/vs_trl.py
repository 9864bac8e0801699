"""parity against TRL's GRPOTrainer on the same workload, side by side, on the CPU or a GPU.

    python -m bench.vs_trl                       # arith model and task, 16 prompts x 8, 8 tokens
    python -m bench.vs_trl --steps 40 --repeats 3
    python -m bench.vs_trl --engines hf,vllm     # parity with its own engine and with vLLM
    python -m bench.vs_trl --model text --task neg-length --max-new-tokens 24
    python -m bench.vs_trl --model smollm2-135m --task neg-length --prompts 8 --max-new-tokens 64 \
        --lr 1e-6 --steps 4 --repeats 1 --micro-batch 8
    python -m bench.vs_trl --device cuda --model smollm2-135m --task neg-length --max-new-tokens 128
    python -m bench.vs_trl --vllm --device cuda --model qwen3-0.6b-shape --task neg-length \
        --max-new-tokens 256 --steps 3 --repeats 1 --micro-batch 16 --trainer-dtype bf16
    python -m bench.vs_trl --model qwen3-narrow-shape --task neg-length \
        --parity bf16-shadow,bf16-shadow:logprob_chunk=-1   # a change's after and before
    python -m bench.vs_trl --vllm --device cuda --model qwen3-0.6b-shape --task neg-length \
        --trl-parity bf16-shadow --parity none   # TRL's trainer against ParityGRPOTrainer

Both sides train the same testbed model on the same task rows with the same reward function
(`arith`: the problems the model solves 20-80% of the time; `neg-length`: text prompts), with
the same prompts per step x completions per prompt, completion length, learning rate,
optimizer (AdamW, constant rate, no weight decay, gradient clip 1.0), GRPO loss (per-sequence
mean, group-normalised advantages, clip 0.2, no KL term), precision (fp32 on both sides:
GRPOConfig(bf16=False), parity's `fp32` recipe) and one optimizer step per generation. TRL runs
without vLLM (`use_cpu=True`) and, to its advantage, without gradient checkpointing (its
default), which only costs time on a model this size.

Each run is its own process; runs alternate over every side, in order then reversed (TRL, parity A,
parity B, parity B, parity A, TRL, ...), so drift on a shared machine hits all. A `--parity`
variant may set config fields over the workload (`RECIPE:KEY=VALUE`), so one run puts a change's
before and after beside the same TRL runs. `peak_gb` is each side's process at its peak: resident
memory (ru_maxrss) on the CPU, the allocator's peak on a GPU. A worker offers itself first to the
kernel's OOM killer. Step time is the median over the steps after the first two (warm-up): for TRL
the wall time between consecutive `on_step_end` callbacks, for parity `time/step_s` (rollout plus
update). The table gives step time, completions/s, completion tokens/s, their ratio, and the mean
reward over the first and the last five steps, so "as fast" is judged at similar learning. The
update alone is each side's step minus its generation (TRL: the time inside
`_generate_and_score_completions`, which also computes rewards and advantages; parity:
`time/train_s`). The last line bounds what any engine could achieve: parity's update alone (forward
with grad, backward, AdamW over the same tokens, which TRL must do too) against TRL's step.

`--trl-parity RECIPE`: a TRL user's swap, TRL's own workload and GRPOConfig with GRPOTrainer
replaced by ParityGRPOTrainer and `ParityOptions.from_recipe(RECIPE)`; its row gives the
step and memory beside TRL's, a second table parity's figures over its steps, and a note the
lines ParityGRPOTrainer wrote for what it changed in the GRPOConfig.

`--vllm`: both sides sample with vLLM, as users run them on a GPU. TRL uses its colocated vLLM
(`use_vllm=True, vllm_mode="colocate"`) with its other defaults: vLLM in bf16 (vLLM's choice for
an fp32 checkpoint), compiled with CUDA graphs, and its importance-sampling correction, which
recomputes the old log-probs with a trainer forward. parity uses `--engine vllm` with its
diagnostics on; `--parity` names its runs (`bf16-shadow`: the shadow forward in the trainer,
`bf16-shadow:scored`: vLLM scores it, `:eager`: decode eagerly rather than from CUDA graphs,
parity's default on a GPU as TRL's). `--trainer-dtype
bf16` trains under bf16 autocast on both sides (TRL `bf16=True`, parity's `bf16` recipe). On a
GPU the table adds each side's peak GPU memory without vLLM's KV cache (TRL's cache is its share
of the GPU, `vllm_gpu_memory_utilization`; parity's is sized to the batch) and the update's MFU:
6 FLOPs per matrix-product weight per completion token over the update's seconds (each side's
step minus its sampling), against the trainer dtype's matrix-product rate measured in the same
process (bench/mfu.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.report import Table, json_option, publish
from parity import metric_names as mn

GIB = 2 ** 30


def _peak_gb(device: str) -> float:
    """The process's peak memory on the side's device: the GPU's allocator, or resident RAM."""
    if device == "cuda":
        import torch
        return torch.cuda.max_memory_allocated() / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def _tensor_bytes(x) -> int:
    import torch
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    if isinstance(x, dict):
        return sum(_tensor_bytes(y) for y in x.values())
    return 0


def _worker_kv_bytes(worker) -> int:
    return _tensor_bytes(getattr(worker.model_runner, "kv_caches", []))


def _vllm_kv_gb(llm) -> float | None:
    """The KV cache vLLM allocated in this process, read from its worker; None where this vLLM
    keeps it elsewhere."""
    try:
        return sum(llm.collective_rpc(_worker_kv_bytes)) / GIB or None
    except Exception:   # a vLLM without callable RPCs or kv_caches: reported as missing
        return None


def _matmul_tflops(dtype: str, device: str) -> float | None:
    """The trainer dtype's matrix-product rate on this GPU, measured now (bench/mfu.py)."""
    if device != "cuda":
        return None
    import torch

    from bench.mfu import matmul_rate
    rate = matmul_rate({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype], 8192,
                       device=torch.device("cuda")) / 1e12
    torch.cuda.empty_cache()  # the workers' vLLM asks for a share of the GPU's free memory
    return rate


def _matmul_params(model_dir) -> int:
    """Weights multiplied per token (bench/mfu.py's count), from a model on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.mfu import matmul_params
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        return matmul_params(AutoModelForCausalLM.from_config(config))


def _memory_start(a: argparse.Namespace) -> None:
    if a.memory_sites and a.device == "cuda":
        from bench.memory_sites import record
        record()


def _memory_sites(a: argparse.Namespace) -> dict | None:
    if not (a.memory_sites and a.device == "cuda"):
        return None
    from bench.memory_sites import at_peak
    try:
        return at_peak(a.memory_sites)
    except Exception as e:  # the side's timings stand; its memory table is reported missing
        print(f"memory sites not measured: {type(e).__name__}: {e}", file=sys.stderr)
        return None


# parity's figures a side reports, each the mean over its steps; TRL's own trainer has none.
FIGURES = (mn.CLIP_FRAC, mn.PHANTOM_FRAC, mn.BETA_ABS_MEAN, mn.KERNEL_GAP_ABS_MEAN)


def trl_worker(a: argparse.Namespace, out: Path) -> dict:
    """TRL's GRPOTrainer; with `--worker trl-parity`, parity's ParityGRPOTrainer with the same
    GRPOConfig and `ParityOptions.from_recipe(a.variant)`, as a TRL user swaps one for the
    other."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from parity import testbed
    from parity.tasks import build_task
    model_dir = testbed.ensure(a.model, progress=False)
    _memory_start(a)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    task = build_task(a.task, None, model_dir, model, tok, a.max_new_tokens, None, a.seed, 1.0,
                      solve_rates=testbed.solve_rates)
    ds = datasets.Dataset.from_list(task.rows)
    reward = task.reward_fns[0].fn  # the very function parity calls, TRL's signature
    stamps: list[float] = []
    gen = [0.0]            # seconds spent sampling and scoring completions so far
    gen_at_step: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())
            gen_at_step.append(gen[0])

    vllm = dict(use_vllm=True, vllm_mode="colocate",
                vllm_gpu_memory_utilization=a.vllm_gpu_memory) if a.vllm else {}
    args = GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=a.device == "cpu", bf16=a.trainer_dtype == "bf16",
        fp16=False, gradient_checkpointing=False, max_steps=a.steps, learning_rate=a.lr,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        per_device_train_batch_size=a.micro_batch or a.prompts * a.group,
        gradient_accumulation_steps=(a.prompts * a.group) // (a.micro_batch or a.prompts * a.group),
        num_generations=a.group,
        max_completion_length=a.max_new_tokens, temperature=1.0, epsilon=0.2, beta=0.0,
        loss_type="grpo", scale_rewards="group", logging_steps=1, save_strategy="no",
        report_to=[], seed=a.seed, disable_tqdm=True, dataloader_num_workers=0, **vllm)
    kw, changes = {}, None
    trainer_cls = GRPOTrainer
    if a.worker == "trl-parity":
        from parity.integrations import trl_config
        from parity.integrations.trl import ParityGRPOTrainer, ParityOptions
        trainer_cls, kw = ParityGRPOTrainer, {"parity": ParityOptions.from_recipe(a.variant)}
        changes = _Lines()
        logging.getLogger(trl_config.__name__).addHandler(changes)
    trainer = trainer_cls(model=model, processing_class=tok, reward_funcs=reward,
                          args=args, train_dataset=ds, callbacks=[Clock()], **kw)
    # TRL's update alone: the step minus its generation (sampling, rewards, advantages, and
    # the old log-probs TRL computes there), the same split as parity's time/train_s.
    generate = trainer._generate_and_score_completions

    def timed(*args, **kw):
        t = time.perf_counter()
        try:
            return generate(*args, **kw)
        finally:
            gen[0] += time.perf_counter() - t
    trainer._generate_and_score_completions = timed
    start = time.perf_counter()
    trainer.train()
    steps = [h for h in trainer.state.log_history if "reward" in h]
    times = [b - a_ for a_, b in zip([start] + stamps[:-1], stamps)]
    gens = [b - a_ for a_, b in zip([0.0] + gen_at_step[:-1], gen_at_step)]
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
    return {"step_s": times, "update_s": [t - g for t, g in zip(times, gens)],
            "reward": [h["reward"] for h in steps], "figures": mean_figures(steps),
            "config_changes": None if changes is None else changes.lines,
            "tokens": [h["completions/mean_length"] * a.prompts * a.group for h in steps],
            "peak_gb": _peak_gb(a.device), "kv_gb": _vllm_kv_gb(llm) if llm else None,
            "memory_sites": _memory_sites(a)}


def mean_figures(steps: list[dict]) -> dict[str, float]:
    """parity's FIGURES that every step logged, each averaged over the steps."""
    return {k: statistics.mean(h[k] for h in steps) for k in FIGURES
            if steps and all(k in h for h in steps)}


class _Lines(logging.Handler):
    """The lines a logger writes, kept: what ParityGRPOTrainer says it changed in the
    GRPOConfig, one line a change, as a user reads them at start-up."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage().removeprefix("parity: "))


FLAGS = ("scored", "eager")


def parse_variant(variant: str) -> tuple[str, list[str], dict[str, str]]:
    """RECIPE[:scored][:eager][:KEY=VALUE...]: the recipe, its flags, and config fields set last
    (so that one run differs from another in one field: `bf16-shadow:logprob_chunk=-1`)."""
    recipe, *rest = variant.split(":")
    flags = [f for f in rest if "=" not in f]
    if bad := [f for f in flags if f not in FLAGS]:
        raise ValueError(f"--parity {variant}: unknown flag {', '.join(bad)} (flags: "
                         f"{', '.join(FLAGS)}; a config field is KEY=VALUE)")
    return recipe, flags, dict(f.split("=", 1) for f in rest if "=" in f)


def parity_config(a: argparse.Namespace, out: Path):
    """The Config of parity's side `a.variant`: the same workload as TRL's, the variant's fields
    over it."""
    from parity.config import make_config
    recipe, flags, fields = parse_variant(a.variant)
    return make_config({"task": a.task, "recipe": recipe, "model": a.model, "steps": a.steps,
                        "lr": a.lr, "prompts_per_step": a.prompts, "samples_per_prompt": a.group,
                        "max_new_tokens": a.max_new_tokens, "seed": a.seed,
                        "optimizer": "adamw", "weight_decay": 0.0, "max_grad_norm": 1.0,
                        "loss_agg": "seq-mean", "out": str(out / "parity"), "progress": False,
                        "save_every": 0, "report_to": "none", "micro_batch": a.micro_batch,
                        "device": a.device, "engine": a.engine,
                        "vllm_gpu_memory": a.vllm_gpu_memory,
                        **({"shadow_kernels": "scored"} if "scored" in flags else {}),
                        "vllm_cuda_graphs": "eager" not in flags, **fields})


def longest_prompt(a: argparse.Namespace, model_dir: Path) -> int:
    """The task's longest prompt in tokens, as parity tokenizes it."""
    from transformers import AutoTokenizer

    from parity import testbed
    from parity.tasks import build_task
    task = build_task(a.task, None, model_dir, None, AutoTokenizer.from_pretrained(model_dir),
                      a.max_new_tokens, None, a.seed, 1.0, solve_rates=testbed.solve_rates)
    return max(map(len, task.prompt_ids))


def parity_worker(a: argparse.Namespace, out: Path) -> dict:
    from parity import testbed
    from parity.reports import load_metrics
    from parity.trainer import train
    _memory_start(a)
    cfg = parity_config(a, out)
    rows = load_metrics(train(cfg) / "metrics.jsonl")
    kv = None
    if a.engine == "vllm":
        from transformers import AutoConfig

        from parity.models.sizes import kv_cache_bytes
        model_dir = testbed.ensure(a.model, progress=False)
        longest = longest_prompt(a, model_dir) + a.max_new_tokens + 1
        # what parity asks vLLM to reserve (parity/engines/vllm.py), not a reading
        kv = kv_cache_bytes(AutoConfig.from_pretrained(model_dir), cfg.engine_dtype,
                            a.prompts * a.group, longest) / GIB
    return {"step_s": [m["time/step_s"] for m in rows], "reward": [m["reward/mean"] for m in rows],
            "tokens": [m["completion/len_mean"] * a.prompts * a.group for m in rows],
            "update_s": [m["time/train_s"] for m in rows], "figures": mean_figures(rows),
            "peak_gb": _peak_gb(a.device), "kv_gb": kv, "memory_sites": _memory_sites(a)}


def _side(side: str) -> tuple[str, str, str]:
    """`side`'s worker, parity engine and variant: `trl`, `trl-parity RECIPE` (TRL's trainer
    swapped for ParityGRPOTrainer) or `parity-ENGINE VARIANT` (`parity train`)."""
    head, _, variant = side.partition(" ")
    worker, _, engine = head.partition("-") if head.startswith("parity-") else (head, "", "")
    return worker, engine or "hf", variant or "fp32"


def proc_gb(path: str, key: str) -> float | None:
    """The figure a /proc file gives as `KEY: N kB`, in GiB; None where the file or key is absent
    (a process that has gone, a system without /proc)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return None


def _wait(proc: subprocess.Popen, cap_gb: float | None) -> bool:
    """Wait for the worker; True where its resident memory passed `cap_gb` and the bench stopped
    it: on a shared machine a run that outgrows its share is ended by the bench, not by the
    kernel's OOM killer, which might pick someone else's process."""
    if cap_gb is None:
        proc.wait()
        return False
    while proc.poll() is None:
        if (proc_gb(f"/proc/{proc.pid}/status", "VmRSS") or 0.0) > cap_gb:
            proc.kill()
            proc.wait()
            return True
        time.sleep(0.1)
    return False


def run_worker(side: str, a: argparse.Namespace, cap_gb: float | None = None) -> dict:
    """`side`: trl, trl-parity RECIPE, or parity-ENGINE VARIANT. A side whose process fails,
    or passes `cap_gb` of resident memory, is reported as such; `run_s` is the process's wall
    time, start-up included."""
    worker, engine, variant = _side(side)
    with tempfile.TemporaryDirectory() as tmp:
        res = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "bench.vs_trl", "--worker", worker,
               "--result", str(res), f"--engine={engine}", f"--variant={variant}",
               *(f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                 if k not in ("worker", "result", "repeats", "engines", "engine", "parity",
                              "trl_parity", "variant", "vllm")),
               *(["--vllm"] if a.vllm else [])]
        t = time.perf_counter()
        proc = subprocess.Popen(cmd)
        capped = _wait(proc, cap_gb)
        if proc.returncode != 0 or not res.exists():
            why = f", stopped past {cap_gb:.1f} GB resident" if capped else ""
            return {"error": f"exit {proc.returncode} after {time.perf_counter() - t:.0f} s{why}"}
        return {**json.loads(res.read_text()), "run_s": time.perf_counter() - t}


def summarize(r: dict, a: argparse.Namespace, params: int | None,
              tflops: float | None) -> dict:
    if "error" in r:
        return r

    def warm(xs: list[float]) -> float:
        """The median after two warm-up steps, or after one in a run too short for two."""
        return statistics.median(xs[2:] or xs[1:] or xs)
    step, tok = warm(r["step_s"]), warm(r["tokens"])
    out = {"step_s": step, "completions_s": a.prompts * a.group / step, "tokens_s": tok / step,
           "reward_first5": statistics.mean(r["reward"][:5]),
           "reward_last5": statistics.mean(r["reward"][-5:]), "peak_gb": r["peak_gb"],
           "kv_gb": r.get("kv_gb"), "memory_sites": r.get("memory_sites"),
           "figures": r.get("figures") or {}, "config_changes": r.get("config_changes")}
    out["update_s"] = warm(r["update_s"])
    if params and tflops:
        # forward and backward over the completion tokens: 6 FLOPs per weight per token
        out["mfu"] = 6 * params * tok / out["update_s"] / (tflops * 1e12)
    return out


def _parity_variants(a: argparse.Namespace) -> list[str]:
    if a.parity == "none":
        return []
    if a.parity:
        return a.parity.split(",")
    if not a.vllm:
        return ["fp32" if a.trainer_dtype == "fp32" else "bf16"]
    return ["bf16-shadow", "bf16-shadow:scored"] if a.trainer_dtype == "fp32" else ["bf16"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="arith")
    ap.add_argument("--task", default="arith", choices=("arith", "neg-length"))
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--micro-batch", type=int, default=0, help="completions per forward and "
                    "backward on both sides (TRL: per-device batch with gradient accumulation; "
                    "parity: micro_batch); 0: the whole step at once")
    ap.add_argument("--repeats", type=int, default=2, help="runs per side, alternating")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="both sides on the "
                    "CPU, or both on the GPU")
    ap.add_argument("--vllm", action="store_true", help="both sides sample with vLLM: TRL's "
                    "colocated vLLM, parity's --engine vllm (default: TRL's own generation)")
    ap.add_argument("--trainer-dtype", default="fp32", choices=("fp32", "bf16"),
                    help="the trainer's arithmetic on both sides: fp32, or bf16 autocast over "
                    "fp32 weights (TRL bf16=True, parity's bf16 recipe)")
    ap.add_argument("--parity", default="", help="parity's runs, comma-separated, a row each: "
                    "RECIPE[:scored][:eager][:KEY=VALUE...], KEY a config field set over the "
                    "bench's workload, e.g. bf16-shadow,bf16-shadow:logprob_chunk=-1 (default: "
                    "fp32 or bf16 without --vllm; with it bf16-shadow,bf16-shadow:scored for an "
                    "fp32 trainer, bf16 for bf16; none: no parity train side)")
    ap.add_argument("--trl-parity", default="", metavar="RECIPES", help="also TRL's own "
                    "workload with GRPOTrainer swapped for ParityGRPOTrainer, the same "
                    "GRPOConfig and ParityOptions.from_recipe(RECIPE): a row each, "
                    "comma-separated, e.g. bf16-shadow (default: none)")
    ap.add_argument("--vllm-gpu-memory", type=float, default=0.3, help="with --vllm on a GPU: "
                    "TRL's vllm_gpu_memory_utilization and parity's vllm_gpu_memory (both "
                    "default to 0.3)")
    ap.add_argument("--engines", default="", help="parity's engines, comma-separated: one "
                    "parity side each (hf, vllm; default: vllm with --vllm, else hf), all "
                    "against the same TRL runs")
    ap.add_argument("--memory-sites", type=int, default=0, metavar="N", help="on a GPU: "
                    "record every allocation's stack (slower: a run for memory, not for time) "
                    "and add a table per side of the N largest allocation sites at its peak "
                    "(bench/memory_sites.py)")
    ap.add_argument("--engine", default="hf", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=("trl", "trl-parity", "parity"), default=None,
                    help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return json_option(ap, "vs_trl")


def sides(a: argparse.Namespace) -> list[str]:
    """The runs' names, a row each: trl, trl-parity RECIPE for each `--trl-parity` recipe, then
    parity-ENGINE VARIANT for each engine and variant."""
    engines = (a.engines or ("vllm" if a.vllm else "hf")).split(",")
    return (["trl"] + [f"trl-parity {r}" for r in a.trl_parity.split(",") if r]
            + [f"parity-{e} {v}" for e in engines for v in _parity_variants(a)])


def check_sides(ap: argparse.ArgumentParser, a: argparse.Namespace, names: list[str]) -> None:
    """Every parity side's config or options, built before any run: a mistyped field is an
    error now, not after the runs before its own."""
    from parity.errors import ParityError
    with tempfile.TemporaryDirectory() as tmp:
        for side in names[1:]:
            worker, engine, variant = _side(side)
            try:
                if worker == "trl-parity":
                    # imported only here: TRL's import takes seconds, a parity side needs none
                    from parity.integrations.trl import ParityOptions
                    ParityOptions.from_recipe(variant)
                else:
                    parity_config(argparse.Namespace(**{**vars(a), "engine": engine,
                                                        "variant": variant}), Path(tmp))
            except (ValueError, ParityError) as e:
                ap.error(f"{side}: {e}")


def _oom_first() -> None:
    """Offer this worker to the kernel's OOM killer before any other process: on a shared
    machine a bench's run, not someone's work, is what should go."""
    try:
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass


def main() -> None:
    ap = parser()
    a = ap.parse_args()
    if a.worker:
        _oom_first()
        fn = parity_worker if a.worker == "parity" else trl_worker
        with tempfile.TemporaryDirectory() as tmp:
            Path(a.result).write_text(json.dumps(fn(a, Path(tmp))))
        return

    names = sides(a)
    check_sides(ap, a, names)
    from parity import testbed
    model_dir = testbed.ensure(a.model)  # built once, before any timed run
    params = _matmul_params(model_dir)
    tflops = _matmul_tflops(a.trainer_dtype, a.device)
    results: dict[str, list[dict]] = {w: [] for w in names}
    for i in range(a.repeats):
        for who in (names if i % 2 == 0 else names[::-1]):
            print(f"run {i + 1}/{a.repeats}: {who} ...", flush=True)
            results[who].append(summarize(run_worker(who, a), a, params, tflops))
            # written after every run: a bench stopped at a time limit keeps the runs it made
            publish("vs_trl", [table(results, a, params, tflops), *figures_table(results),
                               *site_tables(results)], a, device=_device(a))


def _device(a: argparse.Namespace):
    """The bench's device, so that its JSON names the GPU."""
    import torch
    return torch.device(a.device)


def figures_table(results: dict[str, list[dict]]) -> list[Table]:
    """parity's figures on each side that logged them, from its first run; for a ParityGRPOTrainer
    side, what it changed in the GRPOConfig it was given."""
    t = Table("vs_trl_figures", "parity's figures, the mean over each side's steps (first run)",
              [("side", None)] + [(k, "{:.4g}") for k in FIGURES])
    for side, runs in results.items():
        r = next((r for r in runs if r.get("figures")), None)
        if r is None:
            continue
        t.add(side, *(r["figures"].get(k) for k in FIGURES))
        if r.get("config_changes") is not None:
            t.notes.append(f"{side}, what ParityGRPOTrainer changed: "
                           f"{'; '.join(r['config_changes']) or 'nothing'}")
    return [t] if t.rows else []


def site_tables(results: dict[str, list[dict]]) -> list[Table]:
    """Each side's GPU memory at its peak by allocation site (`--memory-sites`), first run."""
    out = []
    for side, runs in results.items():
        sites = next((r["memory_sites"] for r in runs if r.get("memory_sites")), None)
        if sites is None:
            continue
        name = re.sub(r"[^\w.-]", "_", side)  # a table name a docs marker can give
        t = Table(f"memory_sites_{name}",
                  f"{side}: GPU memory at its peak ({sites['peak_gib']:.2f} GiB) by allocation "
                  f"site", [("site", None), ("via", None), ("GiB", "{:.3f}"),
                            ("blocks", "{:.0f}")])
        for row in sites["rows"]:
            t.add(row["site"], row["via"], row["gib"], row["blocks"])
        t.add("(every other site)", "", sites["rest_gib"], None)
        out.append(t)
    return out


def table(results: dict[str, list[dict]], a: argparse.Namespace, params: int,
          tflops: float | None) -> Table:
    cols = ("step_s", "completions_s", "tokens_s", "reward_first5", "reward_last5", "peak_gb")

    def med(w: str, c: str) -> float | None:
        v = [r[c] for r in results[w] if r.get(c) is not None]
        return statistics.median(v) if v else None

    def ratio(x: float | None, y: float | None) -> float | None:
        return x / y if x is not None and y else None

    gpu = a.device == "cuda"
    t = Table("vs_trl", f"workload: {a.model} on {a.task} ({a.device}), {a.prompts} prompts x "
                        f"{a.group} completions, <= {a.max_new_tokens} tokens, {a.steps} steps, "
                        f"{a.trainer_dtype} trainer, "
                        f"{'vLLM on both sides, ' if a.vllm else ''}one process each, "
                        f"{f'micro-batches of {a.micro_batch}, ' if a.micro_batch else ''}"
                        f"{a.repeats} alternating runs per side (medians over runs)",
              [("side", None)] + [(c, "{:.4g}") for c in cols]
              + ([("KV cache GiB", "{:.3g}"), ("peak without KV GiB", "{:.4g}")] if gpu else [])
              + [("update alone s", "{:.4g}"), ("update alone ÷ TRL", "{:.2f}"),
                 ("completions/s ÷ TRL", "{:.2f}x"),
                 ("tokens/s ÷ TRL", "{:.2f}x"), ("TRL step ÷ update alone", "{:.2f}x")]
              + ([("update MFU", "{:.1%}")] if tflops else []))
    for w in results:
        trl = w == "trl"
        kv, peak = med(w, "kv_gb"), med(w, "peak_gb")
        t.add(w, *(med(w, c) for c in cols),
              *([kv, peak - kv if peak is not None and kv is not None else None] if gpu else []),
              med(w, "update_s"),
              None if trl else ratio(med(w, "update_s"), med("trl", "update_s")),
              None if trl else ratio(med(w, "completions_s"), med("trl", "completions_s")),
              None if trl else ratio(med(w, "tokens_s"), med("trl", "tokens_s")),
              None if trl else ratio(med("trl", "step_s"), med(w, "update_s")),
              *([med(w, "mfu")] if tflops else []))
    t.notes += [f"{w} runs: " + (", ".join(f"{r['step_s']:.3f} s/step" if "step_s" in r
                                           else f"failed ({r['error']})" for r in rs)
                                 or "not run")
                for w, rs in results.items()]
    t.notes.append("update alone: the step minus the generation; TRL's step ÷ parity's update "
                   "alone is the most any engine could give against TRL's step")
    if tflops:
        t.notes.append(f"MFU against {tflops:.0f} TFLOP/s ({a.trainer_dtype} 8192^3 products "
                       f"measured in this run), {params / 1e6:.0f}M matrix-product weights")
    if gpu:
        t.notes.append("peak: torch's peak GPU allocation in the side's process; KV cache: "
                       "read from TRL's vLLM worker, parity's the size it asks vLLM for")
    else:
        t.notes.append("peak_gb: the side's process at its peak resident memory (ru_maxrss), "
                       "GiB" + (", without the processes vLLM starts" if a.vllm else ""))
    return t


if __name__ == "__main__":
    main()
