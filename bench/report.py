"""How every bench reports: its tables printed as Markdown and written, with the same rows, to
one JSON file beside the command line, the machine and the date, from which `bench/tables.py`
renders the tables the docs show.

A bench takes `--json PATH` (`json_option`); its default is docs/data/bench/<bench>.json, and
`--json ''` writes nothing. A run of another workload than the docs' should name its own file
(docs/data/bench/<bench>-<variant>.json). Cells hold the measured values themselves, not their
text: a column's format (a `str.format` template) renders them, the same way in the terminal
and in the docs. A missing value (None) renders as —.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "bench"
SCHEMA = 1
# The machine's load as the bench started (when it imports this module, before any work): on a
# shared machine it says whether a table's seconds can be read against another's.
_LOAD_AT_START = os.getloadavg()[0] if hasattr(os, "getloadavg") else None


@dataclass
class Column:
    name: str
    fmt: str | None = None   # e.g. "{:.4f}", "{:.1%}", "{:.2f}x"; None: the value as text
    align: str = ""          # "left" or "right"; empty: right for formatted numbers

    def cell(self, value: Any) -> str:
        if value is None:
            return "—"
        if isinstance(value, bool):
            return "yes" if value else "no"
        if self.fmt and isinstance(value, (int, float)):
            return self.fmt.format(value)
        return str(value)

    def right(self) -> bool:
        return self.align == "right" or (not self.align and self.fmt is not None)


@dataclass
class Table:
    """One table of a bench: `columns` as Column or (name, format) pairs."""

    name: str
    title: str
    columns: list[Column]
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.columns = [c if isinstance(c, Column) else Column(*c) for c in self.columns]

    def add(self, *values: Any) -> None:
        if len(values) != len(self.columns):
            raise ValueError(f"table {self.name!r}: {len(values)} values for "
                             f"{len(self.columns)} columns")
        self.rows.append(list(values))

    def markdown(self) -> str:
        esc = lambda s: s.replace("|", "\\|")  # a cell's bar is not a column's
        lines = ["| " + " | ".join(esc(c.name) for c in self.columns) + " |",
                 "|" + "|".join("---:" if c.right() else "---" for c in self.columns) + "|"]
        lines += ["| " + " | ".join(esc(c.cell(v)) for c, v in zip(self.columns, row)) + " |"
                  for row in self.rows]
        return "\n".join(lines)

    def text(self) -> str:
        """The table as the bench prints it and the docs show it: title, table, notes."""
        parts = [self.title] if self.title else []
        parts.append(self.markdown())
        parts += self.notes
        return "\n\n".join(parts)

    def to_json(self) -> dict:
        return {"name": self.name, "title": self.title,
                "columns": [{"name": c.name, "format": c.fmt, "align": c.align}
                            for c in self.columns],
                "rows": self.rows, "notes": self.notes}

    @classmethod
    def from_json(cls, d: dict) -> Table:
        cols = [Column(c["name"], c.get("format"), c.get("align", "")) for c in d["columns"]]
        return cls(d["name"], d.get("title", ""), cols, d["rows"], d.get("notes", []))


def json_option(ap: argparse.ArgumentParser, bench: str) -> argparse.ArgumentParser:
    """`--json PATH`: where the run's tables go (default docs/data/bench/<bench>.json)."""
    ap.add_argument("--json", default=str(DATA / f"{bench}.json"), metavar="PATH",
                    help="write the tables here as JSON, beside the command line, the machine "
                    f"and the date (default: docs/data/bench/{bench}.json; '' writes nothing)")
    return ap


def engines_option(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--engines hf,vllm`: the rollout engines to run the bench with, one row each
    (parity/engines: `vllm` needs vLLM installed, docs/vllm.md)."""
    from parity.engines import ENGINES
    ap.add_argument("--engines", default="hf", type=lambda v: _engines(v, ENGINES),
                    help=f"rollout engines, comma-separated, a row each: {', '.join(ENGINES)} "
                    "(default: hf)")
    return ap


def _engines(value: str, known: dict) -> list[str]:
    names = [n for n in value.split(",") if n]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown engine {', '.join(bad) or repr(value)}: "
                                         f"choose from {', '.join(known)}")
    return names


def machine(device: torch.device | None = None) -> dict:
    """What the figures were measured on."""
    import torch  # here, so that rendering the docs' tables needs no torch
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "platform": platform.platform(), "cores": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "cpu": _cpu_model(),
           "load_1min_at_start": _LOAD_AT_START,
           "load_1min_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    try:
        import transformers
        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    # Only when a bench ran it: importing vLLM just to name it would cost seconds.
    if "vllm" in sys.modules:
        out["vllm"] = getattr(sys.modules["vllm"], "__version__", "unknown")
    device = device or torch.device("cpu")
    out["device"] = str(device)
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["cuda"] = torch.version.cuda
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def command_line(argv: list[str] | None = None) -> str:
    """The command as it is typed from the repository root: a bench as a module of `bench`."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    if script.parent == ROOT / "bench":
        return "python " + shlex.join(["-m", f"bench.{script.stem}", *argv[1:]])
    if script.is_relative_to(ROOT):
        argv[0] = str(script.relative_to(ROOT))
    return "python " + shlex.join(argv)


def record(bench: str, tables: list[Table], args: argparse.Namespace | dict,
           device: torch.device | None = None) -> dict:
    settings = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    return {"schema": SCHEMA, "bench": bench, "command": command_line(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "settings": {k: v for k, v in settings.items() if k != "json"},
            "machine": machine(device), "tables": [t.to_json() for t in tables]}


def publish(bench: str, tables: list[Table], args: argparse.Namespace,
            device: torch.device | None = None) -> Path | None:
    """Print the tables and write them to `args.json` (unless it is empty)."""
    for t in tables:
        print("\n" + t.text(), flush=True)
    if not args.json:
        return None
    path = Path(args.json).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record(bench, tables, args, device), indent=1,
                               ensure_ascii=False) + "\n")
    print(f"\nwrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return path
