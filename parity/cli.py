"""`parity` command line. Flags for `train` and `audit` are generated from the fields of their
settings (Config, AuditSettings) and those fields' docs.

Errors the user can fix print one line `parity: error: ...` and exit with code 2.
"""

from __future__ import annotations

# Imports inside functions: a command's modules load when it runs, so that `parity --help` and
# every refusal of a setting answer without importing torch (start-up time).
import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from parity import metric_names as mn
from parity import ui
from parity.errors import ParityError
from parity.files import cache_dir, ensure_writable, json_lines

if TYPE_CHECKING:
    from parity.config import Config


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other user error
        raise ParityError(f"{self.prog}: {message}")


def _add_config_flags(p: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    from parity.config import Config, field_specs
    p.add_argument("--config", metavar="FILE", help="YAML file of config fields; flags win.")
    _add_field_flags(p, Config, [n for n in field_specs(Config) if n not in exclude])


def _add_field_flags(p: Any, cls: type, names: Sequence[str]) -> None:
    """A flag per field of a settings dataclass (Config, AuditSettings), its help and default
    from the field's metadata. Values stay as given (None: not given) until `coerce` and the
    field checks, so a bad one is one line naming the field, as it is in a YAML file."""
    from parity.config import field_specs
    specs = field_specs(cls)
    for name in names:
        f = specs[name].field
        flag = "--" + name.replace("_", "-")
        doc = f.metadata["help"]
        if "(default" not in doc:
            doc += f" (default: {f.default})"
        doc = doc.replace("%", "%%")  # argparse formats help with %
        if specs[name].kind is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                           default=None, help=doc)
        elif "const" in f.metadata:  # `--dump-rollouts` alone, or `--dump-rollouts 5`
            p.add_argument(flag, dest=name, default=None, nargs="?", const=f.metadata["const"],
                           metavar=name.upper(), help=doc)
        else:
            p.add_argument(flag, dest=name, default=None,
                           metavar=f.metadata.get("metavar", name.upper()), help=doc)


def explicit_from_args(args: argparse.Namespace, exclude: tuple[str, ...] = ()
                       ) -> dict[str, Any]:
    """Config fields the user gave: the YAML file's, then the flags' (`exclude`: flags of the
    same name that belong to the command, not to the config)."""
    from parity.config import Config, load_yaml
    explicit: dict[str, Any] = load_yaml(args.config) if args.config else {}
    for f in dataclasses.fields(Config):
        if f.name in exclude:
            continue
        v = getattr(args, f.name, None)
        if v is not None:
            explicit[f.name] = v
    return explicit


def config_from_args(args: argparse.Namespace) -> Config:
    from parity.config import make_config
    return make_config(explicit_from_args(args))


# `device` too: a run started on a GPU may continue on the CPU, and the other way round.
RESUME_MAY_CHANGE = ("steps", "progress", "threads", "save_every", "keep_checkpoints",
                     "dump_rollouts", "report_to", "engine_threads", "dist_timeout_s", "device")


def resume_config(args: argparse.Namespace) -> Config:
    """The run's own config.yaml; a resumed run may only run longer or report differently."""
    from parity.config import load_yaml, make_config
    run = Path(args.resume)
    if not run.is_dir():
        raise ParityError(f"--resume {run}: no such run directory")
    if not (run / "config.yaml").is_file():
        raise ParityError(f"--resume {run}: not a run directory (no config.yaml)")
    ensure_writable(run, "--resume")
    given = explicit_from_args(args)
    if args.config:
        raise ParityError("--resume continues the run's own config.yaml; --config does not apply")
    other = [k for k in given if k not in RESUME_MAY_CHANGE]
    if other:
        raise ParityError(f"--resume continues the run's own config; --{other[0].replace('_', '-')}"
                          f" cannot change (only {', '.join(RESUME_MAY_CHANGE)} can)")
    saved = load_yaml(run / "config.yaml")
    try:
        return make_config({**saved, **given, "out": str(run)})
    except ParityError as e:
        raise ParityError(f"--resume {run}: its config.yaml is not valid: {e}") from None


def cmd_train(args: argparse.Namespace) -> None:
    from parity import devices
    from parity.trainer import train
    cfg = resume_config(args) if args.resume else config_from_args(args)
    device = devices.resolve(cfg.device)  # a device this machine lacks: one line, no header
    console = ui.console(stderr=True)
    # One line however long (soft_wrap): piped to a log, rich would break it at 80 columns.
    # Once the model is loaded and every check passed (the trainer's model hook): a refusal
    # while loading is then the only line printed.
    header = lambda model: console.print(
        f"[bold]parity train[/] task={cfg.task} recipe={cfg.recipe} engine={cfg.engine_dtype} "
        f"trainer={cfg.trainer_dtype} ratio={cfg.ratio_source} steps={cfg.steps} "
        f"device={devices.describe(device)}", soft_wrap=True)
    t0 = time.perf_counter()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _stop_on_sigterm()
    run = train(cfg, on_model=header, resume=bool(args.resume))
    if int(os.environ.get("RANK", "0")) != 0:
        return  # rank 0 wrote the metrics and prints the summary
    rows = [row for _, row in json_lines(run / "metrics.jsonl", "metrics file")]
    if rows:
        _summary(rows, run, time.perf_counter() - t0)


def _stop_on_sigterm() -> None:
    """torchrun stops the other ranks with SIGTERM when one fails: say so in one line rather
    than die mid-step without a word (the checkpoints on disk are whole either way)."""
    import signal

    from parity.runs.distributed import RankFailure

    def stop(signum, frame):
        raise RankFailure(f"rank {os.environ.get('RANK', '?')} stopped by the launcher "
                          f"(SIGTERM): another rank failed or the job was cancelled. "
                          f"`parity train --resume RUN` continues from the newest checkpoint")
    signal.signal(signal.SIGTERM, stop)


def _summary(rows: list[dict], run, seconds: float) -> None:
    from rich.table import Table
    first, last = rows[0], rows[-1]
    t = Table(title=f"{run}  ({len(rows)} steps, {seconds / 60:.1f} min)")
    t.add_column("metric")
    t.add_column("step 1", justify="right")
    t.add_column(f"step {last[mn.STEP]}", justify="right")
    t.add_column("best", justify="right")
    for k in (mn.REWARD_MEAN, mn.LEN_MEAN, mn.CLIP_FRAC, mn.KL_K1,
              mn.SYNC_CHANGED_FRAC, mn.LOSS_SCALE, mn.SKIPPED_UPDATES, mn.STEP_S,
              mn.TOKENS_PER_S):
        if k in last:
            # A value JSON cannot hold (NaN) is logged as null: shown as "-", never compared.
            seen = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
            pick = max if k == mn.REWARD_MEAN else min if k == mn.LEN_MEAN else None
            t.add_row(k, _fmt(first.get(k)), _fmt(last.get(k)),
                      _fmt(pick(seen)) if pick and seen else "")
    ui.console().print(t)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, (int, float)) else "-"


def cmd_testbed(args: argparse.Namespace) -> None:
    from rich.table import Table

    from parity import testbed
    from parity.models import pretrained
    cache = cache_dir() if args.cache is None else Path(args.cache)
    if args.action == "list":
        rows = [{"name": name, "kind": s.kind, "arch": s.arch, "layers": s.n_layer,
                 "width": s.d_model, "vocab": s.vocab_size if s.kind != "arith" else "chars",
                 "built": (cache / "models" / name / "config.json").is_file(),
                 "about": s.description} for name, s in testbed.SPECS.items()]
        rows += [{"name": name, "kind": "pretrained", "arch": "", "layers": None, "width": None,
                  "vocab": None, "built": pretrained.is_converted(cache / "models" / name),
                  "about": f"{src.description}; needs `{src.pip}`"}
                 for name, src in pretrained.SOURCES.items()]
        if args.json:
            print(json.dumps({"cache": str(cache), "models": rows}, indent=1))
            return
        t = Table(title=f"built-in models (cache: {cache})")
        for col in ("name", "kind", "arch", "layers", "width", "vocab", "built", "about"):
            # a name is what the user types: never cut (the description wraps instead)
            t.add_column(col, no_wrap=col == "name", min_width=max(len(r["name"]) for r in rows)
                         if col == "name" else None)
        for r in rows:
            t.add_row(*("yes" if v is True else "" if v in (None, False) else str(v)
                        for v in r.values()))
        # Piped, rich would fit the table to 80 columns; a pipe has no width to fit.
        ui.console(1000).print(t)
        return
    known = testbed.known_models()
    names = list(testbed.SPECS) if args.names == ["all"] else args.names
    if not names:
        raise ParityError("testbed build: name at least one model (or `all`, every testbed "
                          "model); see `parity testbed list`")
    for name in names:
        if name not in known:
            raise ParityError(f"unknown built-in model {name!r}; known: {', '.join(known)}")
    ensure_writable(cache, "--cache" if args.cache is not None else "testbed cache")
    for name in names:
        if name in pretrained.SOURCES:
            print(pretrained.build(name, cache, force=args.force))
        else:
            print(testbed.build(name, cache, force=args.force))


def _clip(low: float | None, high: float | None) -> str:
    def one(v: float | None) -> str:
        return "none" if v is None else f"{v:g}"
    return one(low) if low == high else f"{one(low)} / {one(high)}"


def recipe_table() -> tuple[list[str], list[list[str]]]:
    """Every recipe and what it sets, from RECIPES (README.md's table is this one)."""
    from parity.config import RECIPES, Config
    head = ["recipe", "engine", "trainer", "ratio", "clip", "GSPO clip", "correction",
            "what it is"]
    rows = [[f"`{r.name}`" + (" (default)" if r.name == Config.recipe else ""),
             r.settings["engine_dtype"], r.settings["trainer_dtype"], r.settings["ratio_source"],
             _clip(r.settings["eps_low"], r.settings["eps_high"]),
             _clip(r.settings["seq_eps_low"], r.settings["seq_eps_high"]),
             r.settings["correction"], r.description] for r in RECIPES.values()]
    return head, rows


def objective_table() -> tuple[list[str], list[list[str]]]:
    """Every objective and its loss, from its registry entry (README.md's table is this one),
    with Config's defaults in it."""
    from parity.config import Config
    from parity.objectives import OBJECTIVES
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    head = ["objective", "loss (notation: [docs/design.md](docs/design.md); "
                         "`parity/objectives/losses.py` has each next to its equation)"]
    return head, [[f"`{name}`" + (" (default)" if name == Config.objective else ""), loss]
                  for name, loss in ((o.name, o.loss_text.format(**defaults))
                                     for o in OBJECTIVES.values())]


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
    return "\n".join([line(head), "|" + "---|" * len(head), *map(line, rows)]) + "\n"


def readme_tables() -> dict[str, str]:
    """README.md's recipe and objective tables as the code renders them (`parity recipes
    --markdown`; tests/test_readme_tables.py holds README.md to them)."""
    return {"recipe": markdown_table(*recipe_table()),
            "objective": markdown_table(*objective_table())}


def cmd_recipes(args: argparse.Namespace) -> None:
    if args.framework:
        _recipes_for(args.framework, args.names)
        return
    if args.markdown:
        print("\n".join(readme_tables().values()), end="")
        return
    from rich.markup import escape
    from rich.table import Table

    from parity.config import FIELDS
    console = ui.console()
    for title, (head, rows) in (
            ("recipes (parity train --recipe NAME; flags override)", recipe_table()),
            ("objectives (parity train --objective NAME; combine with any recipe)",
             objective_table())):
        t = Table(title=title)
        for col in head:
            t.add_column(col)
        for row in rows:
            # a summary's "[is_cap_low, is_cap]" is text, not one of rich's style tags
            t.add_row(*map(escape, row))
        console.print(t)
    f = Table(title="what the recipes and objectives set")
    f.add_column("field")
    f.add_column("choices and meaning")
    for name in ("ratio_source", "correction", "loss_agg"):
        f.add_row(name, escape(FIELDS[name].metadata["help"]))
    console.print(f)
    console.print("LoRA: add --lora-rank R to any recipe and objective; nothing else changes. "
                  "The engine and the shadow see the adapted weights in the recipe's engine "
                  "dtype (--lora-merge / --no-lora-merge), docs/lora.md.")


def _recipes_for(framework: str, names: list[str]) -> None:
    """Each recipe as the framework's own settings, ready to paste on its command line."""
    from parity.config import RECIPES, recipe
    from parity.integrations.verl import VERL_VERSIONS, recipe_overrides
    for name in names:
        recipe(name)   # an unknown one refused before anything prints
    for name in names or list(RECIPES):
        overrides, missing = recipe_overrides(RECIPES[name].settings)
        print(f"# parity recipe {name} as {framework} {VERL_VERSIONS[-1]} settings "
              f"(docs/verl.md)")
        print(" \\\n".join(overrides))
        for line in missing:
            print(f"# {framework} has no equivalent: {line}")
        print()


def cmd_audit(args: argparse.Namespace) -> int | None:
    from parity.audit import command as au
    from parity.audit import scale as ladder
    from parity.config import TASK_DEFAULTS, Config, coerce, field_specs
    given = {k: coerce(k, getattr(args, k), au.AuditSettings)
             for k in field_specs(au.AuditSettings) if getattr(args, k) is not None}
    if not any(given.get(k) for k in AUDIT_INPUTS):
        given["task"] = Config.task
    if args.scale:
        if given.get("rollouts"):
            raise ParityError("--scale audits the testbed ladder; it does not take --rollouts")
        if given.get("server"):
            raise ParityError("--scale audits the testbed ladder with parity's engine; it does "
                              "not take --server")
        models = args.models.split(",") if args.models else None
        given["model"] = (models or ["ladder"])[0]
        a = au.AuditSettings(**given).validate()
        out = Path(args.out) if args.out else Path("audits") / (
            f"scale-{a.engine_dtype}-vs-{a.trainer_dtype}")
        result = ladder.scale(a, out, models)
        ladder.print_scale(result)
        print(f"wrote {out}/scale.json, {out}/scale.png, {out}/report.html")
        return
    if given.get("model") is None:  # a built-in task's own testbed model, as `train` picks it
        given["model"] = TASK_DEFAULTS.get(given.get("task") or Config.task, {}).get("model")
    a = au.AuditSettings(**given).validate()
    out = Path(args.out) if args.out else au.default_out(a)
    result = au.audit(a, out)
    au.print_audit(result)
    kept = f" {out}/rollouts.jsonl (the server's answers)," if a.server else ""
    print(f"wrote {out}/audit.json, {out}/tokens.parquet,{kept} plots and {out}/report.html")
    # --certify: the certificate's rule is the exit status a CI job reads
    return 1 if "certificate" in result and not result["certificate"]["holds"] else None


SWEEP_AXES = ("recipe", "seed", "task", "model", "out", "threads", "progress")


def _csv(text: str, kind=str) -> list:
    try:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ParityError(f"not a comma-separated list of {kind.__name__}: {text!r}") from None
    if not items:
        raise ParityError(f"empty list: {text!r}")
    return items


def cmd_sweep(args: argparse.Namespace) -> None:
    from parity.experiments.sweep import SweepSpec, print_summary, run_sweep
    overrides = explicit_from_args(args, exclude=SWEEP_AXES)
    for k in SWEEP_AXES:
        if k in overrides:  # from --config: the grid sets these
            raise ParityError(f"sweep: {k!r} in the config file is set by the grid; use "
                              f"--recipes, --seeds, --tasks, --models, --out, --threads")
    _check_device(str(overrides.get("device", "auto")))
    spec = SweepSpec(recipes=_csv(args.recipes), seeds=_csv(args.seeds, int),
                     tasks=_csv(args.tasks), models=_csv(args.models) if args.models else [None],
                     overrides=overrides, workers=args.workers, threads=args.threads)
    out = Path(args.out)
    summary = run_sweep(spec, out, progress=args.progress)
    print_summary(summary)
    print(f"wrote {out}/summary.json, {out}/sweep.png, {out}/report.html")
    if any(not r.get("ok") for r in summary["runs"].values()):
        raise ParityError("sweep: some runs failed; their errors are in summary.json")


def cmd_reproduce(args: argparse.Namespace) -> None:
    from parity.experiments.reproduce import plan_for, print_claims, reproduce
    _check_device(args.device)
    if args.model:
        from parity.experiments.reproduce_real import real_plan_for, reproduce_real
        from parity.models import pretrained
        if args.quick:
            raise ParityError("reproduce: --quick is the testbed's; --model runs the real-model "
                              "reproduction (shorten it with --steps)")
        if args.model not in pretrained.SOURCES or f"{args.model}-bf16" not in pretrained.SOURCES:
            names = [n for n in pretrained.SOURCES if f"{n}-bf16" in pretrained.SOURCES]
            raise ParityError(f"reproduce --model {args.model}: the real-model reproduction "
                              f"runs on a built-in pretrained model: {', '.join(names)}")
        fields = {"model": args.model, "device": args.device,
                  **({"steps": args.steps} if args.steps else {})}
        plan, default_out = real_plan_for(args.engine, **fields)
        out = Path(args.out or default_out)
        with _lock_reproduction(out):
            result = reproduce_real(plan, out, workers=args.workers, progress=args.progress)
        print_claims({**result, "plan": args.model})
        print(f"wrote {out}/claims.md and {out}/claims.json")
        return
    if args.steps:
        raise ParityError("reproduce: --steps applies to the real-model reproduction (--model)")
    base, default_out = plan_for(args.engine, args.quick)
    plan = dataclasses.replace(base, device=args.device)
    out = Path(args.out or default_out)
    with _lock_reproduction(out):
        result = reproduce(plan, out, workers=args.workers, progress=args.progress)
    print_claims(result)
    print(f"wrote {out}/claims.md and {out}/claims.json")


def _lock_reproduction(out: Path) -> Any:
    """`out` held for the reproduction's length (`runs.lock_dir`): a second one into it is
    refused before it reuses, or redoes, a part the first one is still writing."""
    from parity.runs.dirs import lock_dir, refuse_other_output
    ensure_writable(out, "reproduce --out")
    refuse_other_output(out, "a reproduction", "reproduce --out")
    return lock_dir(out, "reproduce --out")


def cmd_report(args: argparse.Namespace) -> None:
    from parity.reports import run_report
    runs = [Path(r) for r in args.runs]
    for r in runs:
        if not r.is_dir():
            raise ParityError(f"run directory {r} does not exist")
    out = Path(args.out) if args.out else (runs[0] if len(runs) == 1 else Path("report"))
    print(f"wrote {run_report(runs, out)}")


def cmd_fp16_check(args: argparse.Namespace) -> int:
    """Exit code 0 when fp16 inference and training are both predicted OK, 1 when a check
    flags a problem (the report says which), 2 for user errors as everywhere else."""
    from parity import fp16_check as fc
    if args.top <= 0:
        raise ParityError(f"--top={args.top} must be > 0")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    result = fc.check(args.model, args.prompts, max_prompts=args.max_prompts,
                      out=Path(args.out) if args.out else None, progress=args.progress,
                      device=args.device)
    fc.print_check(result, top=args.top)
    print(f"wrote {result['out']}/fp16_check.json")
    return 0 if set(result["verdict"].values()) == {"OK"} else 1


def _add_config_option(p: argparse.ArgumentParser, name: str) -> None:
    """A command's flag for Config's field `name` (`--device`, `--threads`, `--progress` of the
    commands that are no run): its default and help are Config's, a value is checked as
    Config's is, and the command reads it as given (`args.NAME`)."""
    from parity.config import FIELDS, Config, check_value, coerce, field_specs
    f = FIELDS[name]
    flag = "--" + name.replace("_", "-")
    doc = f"{f.metadata['help']} (default: {f.default})".replace("%", "%%")
    if field_specs(Config)[name].kind is bool:
        p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=doc)
        return

    def checked(text: str) -> Any:
        value = coerce(name, text, Config)
        check_value(Config, name, value)
        return value
    p.add_argument(flag, type=checked, default=f.default,
                   metavar=f.metadata.get("metavar", name.upper()), help=doc)


def _check_device(setting: str) -> None:
    """A device this machine lacks is refused before any run starts (a sweep would otherwise
    record every run as failed and go on)."""
    from parity import devices
    devices.resolve(setting)


def _add_pool_flags(p: argparse.ArgumentParser, workers_help: str) -> None:
    """The flags of commands that run several trainings in worker processes."""
    p.add_argument("--workers", type=int, default=0, help=workers_help)
    _add_config_option(p, "progress")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="parity", description="Precision-consistent RL for language models.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    tr = sub.add_parser("train", help="GRPO training with precision as a setting.")
    _add_config_flags(tr)
    tr.add_argument("--resume", metavar="RUN_DIR", default=None, help="continue RUN_DIR from "
                    "its newest valid checkpoint (a corrupt one is skipped with a warning)")
    tr.set_defaults(func=cmd_train)
    tb = sub.add_parser("testbed", help="Build or list the built-in models: the tiny testbed "
                         "models, and real pretrained ones converted from installed packages.")
    tb.add_argument("action", choices=("build", "list"))
    tb.add_argument("names", nargs="*", help="model names, or `all`")
    tb.add_argument("--cache", default=None, help="cache directory (default: $PARITY_CACHE or "
                    "~/.cache/parity)")
    tb.add_argument("--force", action="store_true", help="rebuild even if cached")
    tb.add_argument("--json", action="store_true", help="list: the models as JSON (for scripts)")
    tb.set_defaults(func=cmd_testbed)
    rc = sub.add_parser("recipes", help="List the recipes and what they set, and the "
                        "objectives.")
    rc.add_argument("--markdown", action="store_true", help="the tables as README.md shows "
                    "them (Markdown)")
    rc.add_argument("--for", dest="framework", choices=("verl",), default=None,
                    help="each recipe as that framework's settings (docs/verl.md)")
    rc.add_argument("names", nargs="*", metavar="NAME", help="with --for: these recipes "
                    "(default: all)")
    rc.set_defaults(func=cmd_recipes)
    _add_audit_parser(sub)
    _add_fp16_check_parser(sub)
    _add_sweep_parser(sub)
    _add_reproduce_parser(sub)
    rp = sub.add_parser("report", help="Plots and one HTML page for one or more run "
                        "directories, overlaid.")
    rp.add_argument("runs", nargs="+", metavar="RUN_DIR")
    rp.add_argument("--out", default=None, help="where to write (default: the run directory "
                    "for one run, ./report for several)")
    rp.set_defaults(func=cmd_report)
    return p


def _add_sweep_parser(sub) -> None:
    from parity.config import Config
    sw = sub.add_parser("sweep", help="A grid of runs (recipes x seeds x tasks x models) in "
                        "parallel processes, with a summary and an overlay report.")
    sw.add_argument("--recipes", required=True, help="comma-separated recipes")
    sw.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    sw.add_argument("--tasks", default=Config.task, help="comma-separated tasks")
    sw.add_argument("--models", default=None, help="comma-separated models (default: each "
                    "task's own)")
    sw.add_argument("--out", required=True, help="sweep directory; rerunning skips finished runs")
    sw.add_argument("--threads", type=int, default=1, help="torch threads per run (1)")
    _add_pool_flags(sw, "parallel runs (0: cores / threads)")
    _add_config_flags(sw, exclude=SWEEP_AXES)
    sw.set_defaults(func=cmd_sweep)


def _add_reproduce_parser(sub) -> None:
    from parity.config import Config
    from parity.engines import ENGINES
    rq = sub.add_parser("reproduce", help="Measure the published findings on the CPU testbed: "
                        "claims.md with a verdict per claim.")
    rq.set_defaults(func=cmd_reproduce)
    rq.add_argument("--quick", action="store_true", help="the few-minute version (README)")
    rq.add_argument("--model", default=None, help="the real-model reproduction on a built-in "
                    "pretrained model (smollm2-135m) instead of the testbed")
    rq.add_argument("--engine", default=Config.engine, choices=list(ENGINES),
                    help="vllm: vLLM's CPU build as the engine: on the testbed, the arith "
                    "stall, its fixes and the text audits; with --model, the audits and the "
                    "sanity check's fp32, bf16-engine and fp16 runs (docs/vllm.md)")
    rq.add_argument("--steps", type=int, default=0, help="--model only: steps per run "
                    "(0: the real-model plan's own, as in docs/reproduce/smollm2-135m)")
    rq.add_argument("--out", default=None, help="output directory (default: reproduce-quick/, "
                    "reproduce/, reproduce-vllm/, reproduce-MODEL/ or reproduce-MODEL-vllm/); "
                    "a rerun reuses what is done")
    _add_pool_flags(rq, "parallel runs (0: one per core)")
    _add_config_option(rq, "device")


AUDIT_INPUTS = ("task", "prompts", "rollouts")


def _add_audit_parser(sub) -> None:
    from parity.config import AuditSettings, field_specs
    au = sub.add_parser("audit", help="Measure alpha/beta and phantom clipping of a model "
                        "offline, on sampled or given rollouts; or across the size ladder.")
    inputs = au.add_mutually_exclusive_group()
    for name in field_specs(AuditSettings):
        _add_field_flags(inputs if name in AUDIT_INPUTS else au, AuditSettings, [name])
    au.add_argument("--scale", action="store_true", help="audit every model of the testbed "
                    "size ladder and fit the trend against size")
    au.add_argument("--models", default=None, help="with --scale: comma-separated models "
                    "instead of the ladder")
    au.add_argument("--out", default=None, help="output directory (default: audits/...)")
    au.set_defaults(func=cmd_audit)


def _add_fp16_check_parser(sub) -> None:
    fc = sub.add_parser("fp16-check", help="Can this checkpoint run in FP16? Weights, "
                        "activations and gradients against FP16's range, with a verdict "
                        "(exit 1 when a check flags a problem).")
    fc.add_argument("--model", required=True, help="testbed model name or HF model directory")
    fc.add_argument("--prompts", default=None, metavar="FILE", help="sample prompts (.txt, one "
                    "per line, or JSONL/parquet with a `prompt` column; default: a handful of "
                    "built-in text prompts)")
    fc.add_argument("--max-prompts", type=int, default=8, help="prompts to use at most (8)")
    fc.add_argument("--top", type=int, default=10, help="rows per table (10)")
    fc.add_argument("--out", default=None, help="output directory (default: "
                    "audits/<model>-fp16-check[-N])")
    for name in ("device", "threads", "progress"):
        _add_config_option(fc, name)
    fc.set_defaults(func=cmd_fp16_check)


def _check_working_directory() -> None:
    """The working directory still exists: every relative path is read against it, and with it
    gone libraries fail in their own ways (oneMKL stops the process as torch loads)."""
    try:
        os.getcwd()
    except FileNotFoundError:
        raise ParityError("the current directory was deleted: cd to a directory that exists "
                          "and run the command again") from None


class _CtrlC:
    """Ctrl-C stops a command whatever it is doing, for as long as the command runs.

    Python's own handling loses an interrupt in two ways. A process started with SIGINT ignored
    (a non-interactive shell's background job: `parity train ... &` in a script) keeps it
    ignored, so the terminal's Ctrl-C, which reaches the whole job, never stops the run. And a
    KeyboardInterrupt that lands in a `__del__` the garbage collector is running (the regex
    module's, as a tokenizer loads) is printed as "Exception ignored" and dropped, so whether
    the run stops depends on the moment. Here SIGINT is parity's own, and a dropped interrupt
    is raised again in the code the collector interrupted. An interrupt while a module imports
    waits for the import to finish (an extension's C++ would abort on it)."""

    def __init__(self) -> None:
        self.seen, self._owned, self._before = False, False, None

    def __enter__(self) -> "_CtrlC":
        import signal
        import threading
        if threading.current_thread() is threading.main_thread():  # signal.signal's rule
            self._before, self._owned = signal.signal(signal.SIGINT, self._on_sigint), True
        self._hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def __exit__(self, *exc: object) -> None:
        import signal
        sys.unraisablehook = self._hook
        if self._owned:  # None: a handler set outside Python, which Python cannot set again
            signal.signal(signal.SIGINT, self._before if self._before is not None
                          else signal.default_int_handler)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.seen = True
        while frame is not None:
            if frame.f_code is self._unraisable.__code__:
                self._again()   # raised in the hook, it would be dropped once more
                return
            if frame.f_code.co_filename.startswith("<frozen importlib"):
                # A module is importing, and an extension's initialisation may be running
                # Python for C++ (pybind11): a KeyboardInterrupt thrown through it aborts the
                # process (SIGABRT, nothing cleaned up). Taken once the import is done.
                self._again(0.05)
                return
            frame = frame.f_back
        raise KeyboardInterrupt

    def _unraisable(self, u: Any) -> None:
        if isinstance(u.exc_value, KeyboardInterrupt):
            self._again()
        else:
            self._hook(u)

    @staticmethod
    def _again(after_s: float = 0.01) -> None:
        """SIGINT once more, `after_s` from now and from another thread: by then the hook (or
        the import) that asks for it has returned, and the main thread takes it in the code it
        runs next."""
        import _thread
        import signal
        import threading
        main = threading.main_thread().ident

        def later() -> None:
            time.sleep(after_s)
            # a signal to the main thread itself, which also cuts short a wait it is in
            signal.pthread_kill(main, signal.SIGINT)
        _thread.start_new_thread(later, ())


def _interrupted() -> int:
    print("parity: interrupted", file=sys.stderr)
    # A KeyboardInterrupt that passed through code run by exec() of a string (dataclasses and
    # namedtuple make their methods so, as modules import) leaves CPython's flag to end
    # `python -m parity` by SIGINT, status -2 rather than 130, though it was handled here; the
    # next string run by exec lowers it.
    exec("")
    return 130


def main(argv: Sequence[str] | None = None) -> int:
    with _CtrlC() as ctrl_c:
        try:
            _check_working_directory()
            args = build_parser().parse_args(argv)
            code = args.func(args)  # None, or fp16-check's 1 for a flagged problem
        except KeyboardInterrupt:
            return _interrupted()
        except Exception as e:
            # After a Ctrl-C, what fails is what the interrupt cut short (a module half
            # imported, a library that wraps the KeyboardInterrupt in an error of its own):
            # the interrupt is what happened.
            if ctrl_c.seen:
                return _interrupted()
            if not isinstance(e, ParityError):
                raise
            print(f"parity: error: {e}", file=sys.stderr)
            return 2
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
