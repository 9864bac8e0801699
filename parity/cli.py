"""`parity` command line. Flags for `train` are generated from Config's fields and their docs.

Errors the user can fix print one line `parity: error: ...` and exit with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from parity.errors import ParityError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other user error
        raise ParityError(f"{self.prog}: {message}")


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    from parity.config import Config
    p.add_argument("--config", metavar="FILE", help="YAML file of config fields; flags win.")
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        doc = f"{f.metadata['help']} (default: {f.default})"
        if str(f.type).startswith("bool"):
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                           default=None, help=doc)
        else:
            p.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(), help=doc)


def config_from_args(args: argparse.Namespace):
    from parity.config import Config, load_yaml, make_config
    explicit: dict[str, Any] = load_yaml(args.config) if args.config else {}
    for f in dataclasses.fields(Config):
        v = getattr(args, f.name, None)
        if v is not None:
            explicit[f.name] = v
    return make_config(explicit)


def cmd_train(args: argparse.Namespace) -> None:
    from rich.console import Console
    from parity.trainer import train
    cfg = config_from_args(args)
    console = Console(stderr=True)
    console.print(f"[bold]parity train[/] task={cfg.task} recipe={cfg.recipe} "
                  f"engine={cfg.engine_dtype} trainer={cfg.trainer_dtype} "
                  f"ratio={cfg.ratio_source} steps={cfg.steps}")
    t0 = time.perf_counter()
    run = train(cfg)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    _summary(rows, run, time.perf_counter() - t0)


def _summary(rows: list[dict], run, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table
    first, last = rows[0], rows[-1]
    t = Table(title=f"{run}  ({len(rows)} steps, {seconds / 60:.1f} min)")
    t.add_column("metric")
    t.add_column("step 1", justify="right")
    t.add_column(f"step {last['step']}", justify="right")
    t.add_column("best", justify="right")
    for k in ("reward/mean", "completion/len_mean", "clip/frac", "mismatch/kl_k1",
              "sync/changed_frac", "loss/scale", "train/skipped_updates", "time/step_s",
              "throughput/tokens_per_s"):
        if k in last:
            best = max(r[k] for r in rows) if k == "reward/mean" else (
                min(r[k] for r in rows) if k == "completion/len_mean" else None)
            t.add_row(k, f"{first[k]:.4g}", f"{last[k]:.4g}", "" if best is None else f"{best:.4g}")
    Console().print(t)


def cmd_testbed(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table
    from parity import testbed
    cache = testbed.cache_dir() if args.cache is None else Path(args.cache)
    if args.action == "list":
        t = Table(title=f"testbed models (cache: {cache})")
        for col in ("name", "kind", "arch", "layers", "width", "vocab", "built", "about"):
            t.add_column(col)
        for name, s in testbed.SPECS.items():
            built = "yes" if (cache / "models" / name / "config.json").is_file() else ""
            t.add_row(name, s.kind, s.arch, str(s.n_layer), str(s.d_model),
                      str(s.vocab_size) if s.kind == "text" else "chars", built, s.description)
        Console().print(t)
        return
    names = list(testbed.SPECS) if args.names == ["all"] else args.names
    if not names:
        raise ParityError("testbed build: name at least one model (or `all`); see "
                          "`parity testbed list`")
    for name in names:
        if name not in testbed.SPECS:
            raise ParityError(f"unknown testbed model {name!r}; known: "
                              f"{', '.join(testbed.SPECS)}")
    for name in names:
        print(testbed.build(name, cache, force=args.force))


def cmd_recipes(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table
    from parity.config import RECIPES
    t = Table(title="recipes (parity train --recipe NAME; flags override)")
    for col in ("recipe", "description", "sets"):
        t.add_column(col)
    for r in RECIPES.values():
        t.add_row(r.name, r.description, " ".join(f"{k}={v}" for k, v in r.settings.items()))
    Console().print(t)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="parity", description="Precision-consistent RL for language models.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    tr = sub.add_parser("train", help="GRPO training with precision as a setting.")
    _add_config_flags(tr)
    tr.set_defaults(func=cmd_train)
    tb = sub.add_parser("testbed", help="Build or list the tiny testbed models.")
    tb.add_argument("action", choices=("build", "list"))
    tb.add_argument("names", nargs="*", help="model names, or `all`")
    tb.add_argument("--cache", default=None, help="cache directory (default: $PARITY_CACHE or "
                    "~/.cache/parity)")
    tb.add_argument("--force", action="store_true", help="rebuild even if cached")
    tb.set_defaults(func=cmd_testbed)
    rc = sub.add_parser("recipes", help="List the recipes and what they set.")
    rc.set_defaults(func=cmd_recipes)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        args.func(args)
    except ParityError as e:
        print(f"parity: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("parity: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
