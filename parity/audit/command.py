"""`parity audit`: how much of a model's clipping is numerical, measured offline.

    completions + ℓ_μ   sampled here by the engine in engine dtype, or read from another
                        system's file (docs/design.md's audit input)
    ℓ_π                 the trainer's forward in trainer dtype, no grad, θ = θ_old
    ℓ_s                 the shadow forward in engine dtype on the same weights
    → α, β, clip attribution at ε and over a sweep of ε, exact KL(μ‖π) where μ is known
    → audit.json, tokens.parquet, plots, report.html, a verdict table

`parity audit --scale` (scale.py) repeats it over the testbed's size ladder.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.table import Table

from parity import cpu_bf16, devices, testbed, ui
from parity import metric_names as mn
from parity.audit import locate as lc
from parity.audit import server as server_audit
from parity.audit.advice import advise, as_json, fp16_fit, print_advice, what_to_do
from parity.audit.inputs import (
    check_routing,
    read_prompts,
    read_rollouts,
    rollout_advantages,
    to_rollout,
)
from parity.audit.locate_report import locate_sections, print_located
from parity.audit.measurement import Measurement
from parity.audit.routing_report import print_routing, routing_sections
from parity.config import AuditSettings
from parity.config import certificate as cert
from parity.diagnostics import (
    Shadow,
    exact_kl_rows,
    write_dump,
)
from parity.engines import Engine, EngineSpec, check_engine, make_engine, stop_token_ids
from parity.engines.server import Server
from parity.errors import ParityError
from parity.logprobs import Sampling
from parity.models import invariant, lora, routing
from parity.models.loading import load_policy, max_positions
from parity.models.precision import fp32_head
from parity.objectives import grpo_advantages
from parity.reports import audit_report
from parity.runs.dirs import check_run_dir, free_dir, lock_dir
from parity.tasks import PromptSampler, build_task, prompt_token_ids
from parity.ui import progress

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from parity.tasks import Task


def _prompts(a: AuditSettings, model: torch.nn.Module, tok: PreTrainedTokenizerBase,
             model_dir: Path) -> tuple[Task | None, list[Any], list[list[int]], str]:
    """(the task or None, each prompt as given, its token ids, where the prompts come from)."""
    if a.prompts:
        texts = read_prompts(a.prompts)
        prompt_ids = [prompt_token_ids(tok, t, a.chat_template,
                                       f"prompts file {a.prompts}: prompt {i}")
                      for i, t in enumerate(texts)]
        limit = max_positions(model)
        for i, ids in enumerate(prompt_ids):
            if not ids:
                raise ParityError(f"prompts file {a.prompts}: prompt {i} tokenizes to nothing")
            if limit is not None and len(ids) + a.max_new_tokens > limit:
                raise ParityError(f"prompts file {a.prompts}: prompt {i} is {len(ids)} tokens; "
                                  f"with max_new_tokens={a.max_new_tokens} it exceeds the "
                                  f"model's context of {limit}")
        return None, texts, prompt_ids, f"prompts file {a.prompts}"
    task = build_task(a.task, a.reward, model_dir, model, tok, a.max_new_tokens,
                      max_positions(model), a.seed, a.temperature,
                      chat_template=a.chat_template, solve_rates=testbed.solve_rates)
    return task, [r["prompt"] for r in task.rows], task.prompt_ids, f"task {a.task}"


def _sample(a: AuditSettings, model: torch.nn.Module, tok: PreTrainedTokenizerBase,
            model_dir: Path, meas: Measurement, shadow: Shadow, s: Sampling, bar: ui.Bar) -> str:
    task, _, prompt_ids, source = _prompts(a, model, tok, model_dir)
    max_len = max(map(len, prompt_ids)) + a.max_new_tokens
    check_engine(a.engine, model.config, dataclasses.replace(a.engine_needs(), max_len=max_len))
    engine = make_engine(a.engine, EngineSpec(
        model, str(model_dir), a.engine_dtype, stop_token_ids(model, tok), tok.pad_token_id,
        a.seed, max_len, a.batch_size, a.cpu_fp16, a.lm_head_fp32))
    if a.shadow_kernels == "scored":
        shadow.engine = engine   # the engine scores ℓ_s itself
    try:
        source = _sample_with(a, engine, prompt_ids, task, source, model, tok, meas, shadow, s,
                              bar)
        meas.trace(model, engine, f"engine={a.engine}")
        return source
    finally:
        engine.close()


def _sample_with(a: AuditSettings, engine: Engine, prompt_ids: list[list[int]],
                 task: Task | None, source: str, model: torch.nn.Module,
                 tok: PreTrainedTokenizerBase, meas: Measurement, shadow: Shadow, s: Sampling,
                 bar: ui.Bar) -> str:
    order = PromptSampler(len(prompt_ids), a.seed)
    gen = torch.Generator().manual_seed(a.seed)
    per_batch = max(1, a.batch_size // a.group)
    done = 0
    while done < a.samples:
        n_prompts = min(per_batch, math.ceil((a.samples - done) / a.group))
        rows = order.next(n_prompts)
        batch = [prompt_ids[i] for i in rows for _ in range(a.group)]
        r = engine.generate(batch, a.max_new_tokens, s, gen,
                            exact_kl_rows(len(batch), a.kl_exact_rows))
        adv = None
        if task is not None:
            comp = r.completions()
            texts = tok.batch_decode(comp, skip_special_tokens=True)
            rewards = torch.tensor(task.rewards([i for i in rows for _ in range(a.group)],
                                                texts, comp), device="cpu")
            adv = grpo_advantages(rewards, a.group)
        pids = torch.tensor([i for i in rows for _ in range(a.group)], device="cpu")
        meas.add(model, shadow, r, adv, s, pids, done)
        done += len(batch)
        bar.completed(min(done, a.samples))
    return source


def _serve(a: AuditSettings, model: torch.nn.Module, tok: PreTrainedTokenizerBase,
           model_dir: Path, s: Sampling, path: Path) -> tuple[dict[str, Any], str]:
    """Sample from the server into the rollouts file `path`; what was found about the server,
    and where the prompts came from."""
    server = Server(a.server, a.server_timeout_s)
    info = server_audit.served_model(server, a, model_dir)
    task, prompts, prompt_ids, source = _prompts(a, model, tok, model_dir)
    lines = server_audit.sample(server, a, info, model, tok, task, prompts, prompt_ids, s)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    try:
        rows = _rows(path, model, tok)
    except ParityError as e:
        # `path` is a staging file, gone once the audit is refused: name what the user can see.
        raise ParityError(str(e).replace(str(path), f"the answers of server {server.url}")
                          ) from None
    info.update(server_audit.logprobs_kind(model, tok, rows, a, s))
    return info, f"server {server.url} ({info['model']}), {source}"


def _rows(path: Path, model: torch.nn.Module, tok: PreTrainedTokenizerBase
          ) -> list[dict[str, Any]]:
    vocab = model.get_output_embeddings().weight.shape[0]
    rows = read_rollouts(path, vocab, tok)
    limit = max_positions(model)
    for i, r in enumerate(rows):
        n = len(r["prompt_token_ids"]) + len(r["completion_token_ids"])
        if limit is not None and n > limit:
            raise ParityError(f"{path} row {i}: prompt + completion is {n} tokens, beyond "
                              f"the model's context of {limit}")
    check_routing(rows, str(path), model)
    return rows


def _replay(a: AuditSettings, path: Path, model: torch.nn.Module, tok: PreTrainedTokenizerBase,
            meas: Measurement, shadow: Shadow, s: Sampling, bar: ui.Bar) -> str:
    rows = _rows(path, model, tok)
    adv = rollout_advantages(rows)
    keys = {}
    prompt_index = torch.tensor([keys.setdefault(tuple(r["prompt_token_ids"]), len(keys))
                                 for r in rows], device="cpu")
    for start in range(0, len(rows), a.batch_size):
        chunk = rows[start:start + a.batch_size]
        r = to_rollout(chunk, tok.pad_token_id, tok.eos_token_id,
                       routing.shape(model)[1] if routing.is_moe(model) else 0)
        meas.add(model, shadow, r, None if adv is None else adv[start:start + len(chunk)], s,
                 prompt_index[start:start + len(chunk)], start)
        bar.completed(start + len(chunk))
    return f"rollouts file {path}"


def default_out(a: AuditSettings) -> Path:
    engine = "server" if a.server else a.engine_dtype
    return free_dir(Path("audits") / f"{Path(a.model).name}-{engine}-vs-{a.trainer_dtype}")


def audit(a: AuditSettings, out: Path | None = None, report: bool = True) -> dict[str, Any]:
    """Run one audit; returns audit.json's content. Input is checked before `out` is written,
    and `out` is held for the audit's length (`runs.lock_dir`): a second audit into it is
    refused, never left to overwrite this one's files."""
    t0 = time.perf_counter()
    device, out = _refuse_early(a, out)
    with lock_dir(out, "audit --out", empty=True), cpu_bf16.restored():
        return _locked_audit(a, out, report, device, t0)


def _locked_audit(a: AuditSettings, out: Path, report: bool, device: torch.device, t0: float
                   ) -> dict[str, Any]:
    model_dir, model, tok = _policy(a, device)
    if a.locate:
        lc.check_traceable(model)
    torch.manual_seed(a.seed)
    s = Sampling(a.temperature, a.top_p, a.top_k)
    if a.lm_head_fp32:
        fp32_head(model)
    shadow = Shadow(model, a.engine_dtype, a.trainer_dtype, a.cpu_fp16, a.lm_head_fp32,
                    chunk=a.logprob_chunk, kernels=a.shadow_kernels)
    meas = Measurement(a, device)
    source, server = _measure(a, out, model, tok, model_dir, meas, shadow, s)
    result = {"model": a.model, "model_dir": str(model_dir),
              "n_params": sum(p.numel() for p in model.parameters()),
              "engine_dtype": a.engine_dtype, "trainer_dtype": a.trainer_dtype,
              "lm_head_fp32": a.lm_head_fp32, "kernels": a.kernels, "input": source, "eps": a.eps,
              "max_new_tokens": a.max_new_tokens,
              "seed": a.seed, "device": devices.describe(device),
              "sampling": {"temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k},
              **meas.results(), **meas.located(), **({"server": server} if server else {}),
              "seconds": time.perf_counter() - t0}
    if a.certify:
        result["certificate"] = cert.certificate(result, result["metrics"].get(
            mn.LOG_RATIO_ABS_MAX), meas.log_exp_gap_mean(), a.certify)
    result["verdict"] = verdict(result)
    result["advice"] = as_json(advise(result, a.fp16_check))
    _write(a, out, result, meas, report)
    return result


def _refuse_early(a: AuditSettings, out: Path | None) -> tuple[torch.device, Path]:
    """Every check that needs no model: the settings, the device, the output directory, the
    engine and the fp16-check file. Returns the device and the output directory."""
    a.validate()
    device = devices.resolve(a.device)
    if a.threads:
        torch.set_num_threads(a.threads)
    out = out or default_out(a)
    check_run_dir(out)
    if (a.rollouts or a.server) and a.shadow_kernels == "scored":
        # Answers from a file or a server have no engine in this process to score them.
        raise ParityError(f"shadow_kernels=scored needs the engine that sampled: audit a --task "
                          f"or --prompts with parity's engine, not "
                          f"{'--rollouts' if a.rollouts else '--server'}")
    check_engine(a.engine)
    fp16_fit(a.fp16_check)   # a bad file is refused now, not after the sampling
    return device, out


def _policy(a: AuditSettings, device: torch.device
            ) -> tuple[Path, torch.nn.Module, PreTrainedTokenizerBase]:
    """The trainer's model (with the LoRA adapter, if any) on `device`, and its tokenizer."""
    model_dir = testbed.resolve_model(a.model)
    model, tok = load_policy(model_dir)
    if a.adapter:
        model = lora.from_adapter(model, a.adapter, a.lora_merge)
    model.eval().to(device)  # before the engine's and the shadow's copies are made from it
    if a.kernels == "invariant":
        invariant.use(model)
    return model_dir, model, tok


def _measure(a: AuditSettings, out: Path, model: torch.nn.Module, tok: PreTrainedTokenizerBase,
             model_dir: Path, meas: Measurement, shadow: Shadow, s: Sampling
             ) -> tuple[str, dict[str, Any] | None]:
    """Sample or read the completions into `meas`: where they came from, and what was found
    about the server where one sampled them."""
    with tempfile.TemporaryDirectory() as staging:
        # A server's answers are kept as a rollouts file and audited as --rollouts reads one;
        # it is moved into `out` with the rest, so a refusal leaves nothing behind.
        saved = Path(staging) / "rollouts.jsonl"
        server = _serve(a, model, tok, model_dir, s, saved) if a.server else None
        total = None if a.rollouts else a.samples
        with progress("audit", total, a.progress, transient=True) as bar:
            if a.rollouts or server:
                source = _replay(a, saved if server else Path(a.rollouts), model, tok, meas,
                                 shadow, s, bar)
                meas.trace(model, None, "answers from a server" if server else
                           "answers from a file")
            else:
                source = _sample(a, model, tok, model_dir, meas, shadow, s, bar)
        if server:
            out.mkdir(parents=True, exist_ok=True)
            shutil.move(saved, out / "rollouts.jsonl")
            return server[1], server[0]
    return source, None


def _write(a: AuditSettings, out: Path, result: dict[str, Any], meas: Measurement,
           report: bool) -> None:
    """audit.json, tokens.parquet and, with `report`, the plots and report.html."""
    out.mkdir(parents=True, exist_ok=True)
    write_dump(out / "tokens.parquet", meas.tables)
    (out / "audit.json").write_text(json.dumps(result, indent=1))
    if report:
        tokens, seqs = meas.arrays()
        summary = {k: v for k, v in result["metrics"].items() if "/" in k and
                   not k.startswith((mn.prefix(mn.BETA_BY_PROB), mn.prefix(mn.BETA_BY_POS)))}
        audit_report(tokens, seqs, result["phantom_vs_eps"], summary, out,
                     f"parity audit: {a.model}, {a.engine_dtype} engine vs {a.trainer_dtype} "
                     f"trainer ({result['input']})", verdict=result["verdict"],
                     advice=what_to_do(result),
                     extra=[*routing_sections(result, out),
                            *(locate_sections(result, out) if "locate" in result else ())])


def verdict(result: dict[str, Any]) -> str:
    m, eps = result["metrics"], result["eps"]
    ph = m.get(mn.PHANTOM_FRAC, 0.0)
    reach = next((row["eps"] for row in sorted(result["phantom_vs_eps"], key=lambda r: -r["eps"])
                  if row["phantom_frac"] >= 0.01), None)
    if ph >= 0.01:   # which fix fits is the advice's to say (parity/audit/advice.py)
        return f"numerics alone clip {ph:.1%} of tokens at eps={eps:g}"
    where = f"; it reaches 1% at eps={reach:g}" if reach is not None else ""
    return f"phantom clipping at eps={eps:g} is {ph:.2%} of tokens{where}"


def print_audit(result: dict[str, Any]) -> None:
    m = result["metrics"]
    t = Table(title=f"{result['model']}: {result['engine_dtype']} engine vs "
                    f"{result['trainer_dtype']} trainer, {result['completions']} completions, "
                    f"{result['tokens']} tokens")
    t.add_column("measure")
    t.add_column("value", justify="right")
    for label, key, fmt in (
            ("|log pi - log mu| mean (engine vs trainer)", mn.LOG_RATIO_ABS_MEAN, ".3g"),
            ("|beta| mean", mn.BETA_ABS_MEAN, ".3g"),
            ("beta mean", mn.BETA_MEAN, ".3g"),
            ("beta std", mn.BETA_STD, ".3g"),
            ("max |beta|", mn.BETA_ABS_MAX, ".3g"),
            ("KL(mu||pi) exact", mn.KL_EXACT, ".3g"),
            ("KL k1", mn.KL_K1, ".3g"),
            ("KL k3", mn.KL_K3, ".3g"),
            ("max |pi - mu|", mn.PROB_DIFF_MAX, ".3g"),
            ("kernel gap |alpha| (theta = theta_old)", mn.ALPHA_ABS_MEAN, ".3g"),
            ("corr(beta, A)", mn.BETA_ADV_CORR, ".3f"),
            ("seq log-ratio slope per 1k tokens", mn.SEQ_LOG_RATIO_SLOPE, "per1k"),
            (f"clipped at eps={result['eps']:g}", mn.CLIP_FRAC, ".2%"),
            (f"phantom-clipped at eps={result['eps']:g}", mn.PHANTOM_FRAC, ".2%"),
            (f"hidden at eps={result['eps']:g}", mn.HIDDEN_FRAC, ".2%")):
        if key in m:
            v = m[key]
            t.add_row(label, f"{v * 1000:.3g}" if fmt == "per1k" else format(v, fmt))
    for row in result["phantom_vs_eps"]:
        if row["eps"] in (0.01, 0.05):
            t.add_row(f"phantom-clipped at eps={row['eps']:g}", f"{row['phantom_frac']:.2%}")
    console = ui.console(120)
    console.print(t)
    if "server" in result:
        console.print(server_lines(result["server"]), highlight=False)
    console.print(f"verdict: {result['verdict']}")
    print_routing(result, console)
    if "locate" in result:
        print_located(result, console)
    if "certificate" in result:
        console.print(cert.line(result["certificate"]), highlight=False)
    if "advice" in result:
        print_advice(result, console)


def server_lines(v: dict[str, Any]) -> str:
    """What the audit found about the server it sampled, in a few lines."""
    context = f", context {v['max_model_len']}" if v.get("max_model_len") else ""
    out = [f"server {v['url']} serves {v['model']!r} (root {v['root']}{context}); against the "
           f"trainer's model: {v['trainer_model_match']}; asked at {v['endpoint']}, prompts "
           f"tokenized as the trainer does: {v['prompts_as_trainer_tokenizes']}"]
    if "mean_abs_diff_to_processed" in v:
        out.append(f"server log-probs: {v['logprobs']} (over {v['tokens']} tokens, mean |diff| "
                   f"to the trainer's processed log-probs {v['mean_abs_diff_to_processed']:.3g}, "
                   f"to its raw ones {v['mean_abs_diff_to_raw']:.3g})")
    else:
        out.append(f"server log-probs: {v['logprobs']}")
    return "\n".join(out)
