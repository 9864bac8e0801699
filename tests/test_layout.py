"""The architecture as CONTRIBUTING.md's "The layout" draws it, checked on the source: data flows
one way (the command line → the experiments → the library's components), the import graph has no
cycle, and no function grows past what one can read at once."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "parity"
# The command line: the only modules that may import anything, experiments included.
ENTRY_POINTS = {"parity.cli", "parity.__main__"}
# The experiments (the seeds' reproduction, its claims and the sweeps that run it) are an
# application on top of the library: they import its components, never the reverse.
EXPERIMENTS = "parity.experiments"
# Who may run the trainer: the command line and the sweep (one training per worker).
TRAINER_USERS = {"parity.cli", "parity.experiments.sweep"}
# Commands the command line runs (each one a whole job). Components never reach up to them.
COMMANDS = {"parity.trainer", "parity.audit.command", "parity.audit.locate_report",
            "parity.audit.routing_report",
            "parity.audit.scale", "parity.audit.server",
            "parity.fp16_check", "parity.reports"}
MAX_LINES = 60
# The library's layers, lowest first: a module imports only from its own layer or those below,
# so the packages' directions hold (a module belongs to the longest prefix that names it).
# CONTRIBUTING.md's "The layout" draws them.
LAYERS = [
    ("base", ["parity.errors", "parity.files", "parity.ui", "parity.cpu_bf16", "parity.devices",
              "parity.metric_names", "parity.registry"]),
    # what the rest speaks in: task data, the rollout batch, the registries' entries, the
    # run directory; none of them samples or trains
    ("data", ["parity.tasks", "parity.logprobs", "parity.engines.rollout",
              "parity.engines.abilities", "parity.objectives", "parity.runs.distributed",
              "parity.runs.dirs", "parity.runs.loggers"]),
    ("models", ["parity.models", "parity.runs.memory", "parity.runs.checkpoints"]),
    ("engines and settings", ["parity.engines", "parity.testbed", "parity.config"]),
    ("measurement and run parts", ["parity.diagnostics", "parity.runs", "parity.reports"]),
    ("commands and integrations", ["parity.trainer", "parity.audit", "parity.fp16_check",
                                   "parity.integrations"]),
    ("application", ["parity.experiments", "parity.cli", "parity.__main__", "parity"]),
]
TOP_LEVEL_LIMIT = 15


def modules(root: Path = PKG) -> dict[str, ast.Module]:
    """Every module of the package by its dotted name (a package by its own name)."""
    return dict(_parsed(root))


@functools.cache   # parsed once for the module's checks; none of them changes a tree
def _parsed(root: Path) -> dict[str, ast.Module]:
    out = {}
    for p in root.rglob("*.py"):
        parts = ("parity", *p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = ast.parse(p.read_text())
    return out


def imported(tree: ast.Module, known: set[str], annotations: bool = False) -> set[str]:
    """The parity modules a file imports, anywhere in it (lazy imports included): `from a.b
    import c` is module a.b.c where that is a module, else a.b. Imports under `if
    TYPE_CHECKING:` count only with `annotations`."""
    out = set()
    typing_only = set() if annotations else {id(n) for node in ast.walk(tree)
                                             if _type_checking(node) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue  # an import for annotations only is no dependency of the running code
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("parity"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("parity"))
    return out & known


def _type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:`"""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING")


def graph(mods: dict[str, ast.Module], annotations: bool = False) -> dict[str, set[str]]:
    known = set(mods)
    return {name: imported(tree, known, annotations) - {name} for name, tree in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_check_finds_a_cycle_and_only_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles():
    assert not cycles(graph(modules())), cycles(graph(modules()))


def test_no_import_cycles_through_annotations_either():
    """An import for annotations only (under `if TYPE_CHECKING:`) runs nothing, but it still
    ties two modules together for a reader, a type checker and a refactoring tool."""
    found = cycles(graph(modules(), annotations=True))
    assert not found, found


def test_the_counting_of_annotation_imports():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import parity.b\n")
    assert imported(tree, {"parity.b"}) == set()
    assert imported(tree, {"parity.b"}, annotations=True) == {"parity.b"}


def test_the_library_never_imports_an_experiment():
    found = {(name, dep) for name, deps in graph(modules()).items()
             if not name.startswith(EXPERIMENTS) and name not in ENTRY_POINTS
             for dep in deps if dep.startswith(EXPERIMENTS)}
    assert not found, found


def test_only_the_entry_points_import_the_trainer():
    users = {name for name, deps in graph(modules()).items() if "parity.trainer" in deps}
    assert users <= TRAINER_USERS, users - TRAINER_USERS


def layer(name: str) -> int:
    """The index in LAYERS of the longest prefix that names module `name`."""
    best = max(((len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
                if name == prefix or name.startswith(prefix + ".")), default=None)
    assert best is not None, f"{name} is in no layer of LAYERS"
    return best[1]


def test_every_module_named_here_exists():
    known = set(modules())
    named = (ENTRY_POINTS | TRAINER_USERS | COMMANDS
             | {p for _, prefixes in LAYERS for p in prefixes})
    assert named <= known, named - known


def test_the_layer_check_finds_an_upward_import():
    assert layer("parity.tasks.data") < layer("parity.engines.hf")
    assert layer("parity.logprobs.scoring") < layer("parity.models.forward") < layer(
        "parity.engines.hf")


def test_the_packages_import_downward_only():
    """Task data never reaches an engine, the models never reach a command, and so on up."""
    found = sorted(f"{name} ({LAYERS[layer(name)][0]}) imports {dep} ({LAYERS[layer(dep)][0]})"
                   for name, deps in graph(modules()).items()
                   for dep in deps if layer(dep) > layer(name))
    assert not found, found


def test_few_modules_at_the_top():
    """Concepts live in packages; the top of parity/ holds the command line and what every
    package shares."""
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= TOP_LEVEL_LIMIT, top


def test_components_never_import_a_command():
    found = {(name, dep) for name, deps in graph(modules()).items()
             if name not in COMMANDS | ENTRY_POINTS and not name.startswith(EXPERIMENTS)
             for dep in deps & COMMANDS}
    assert not found, found


def test_the_models_never_import_an_engine():
    """A model is what the engines sample with and the trainer scores with: parity/models sits
    below every engine, the rollout batch's module included, annotations too."""
    found = sorted(f"{name} imports {dep}"
                   for name, deps in graph(modules(), annotations=True).items()
                   if name.startswith("parity.models") for dep in deps
                   if dep.startswith("parity.engines"))
    assert not found, found


def test_the_engines_sit_behind_their_interface():
    """Outside parity/engines, an engine implementation is reached through the registry
    (`make_engine`), never imported by name: the trainer, the audit and the integrations hold an
    `Engine`. The parity engine's own model class is the exception where a caller needs parity's
    sampling on a model it holds (the TRL integration, the arith calibration)."""
    found = {(name, dep) for name, deps in graph(modules()).items()
             if not name.startswith("parity.engines") for dep in deps
             if dep == "parity.engines.vllm"}
    assert not found, found


def test_no_function_over_60_lines():
    long = [f"{name}:{f.lineno} {f.name} ({f.end_lineno - f.lineno + 1} lines)"
            for name, tree in modules().items() for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and f.end_lineno - f.lineno + 1 > MAX_LINES]
    assert not long, long


MODULE_NOTE = "# Imports inside functions:"


def function_imports(tree: ast.Module) -> list[ast.stmt]:
    return [n for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_an_import_inside_a_function_says_why():
    """An import belongs at the top, where the reader and this file's graph see it. One inside a
    function is for an optional dependency or for start-up time, and says which: in a comment
    on its line or the line above, or once for the module in a line starting MODULE_NOTE."""
    silent = []
    for p in sorted(PKG.rglob("*.py")):
        lines = p.read_text().splitlines()
        if any(line.startswith(MODULE_NOTE) for line in lines):
            continue
        for n in function_imports(ast.parse("\n".join(lines))):
            here, above = lines[n.lineno - 1], lines[n.lineno - 2].strip()
            if "#" not in here and not above.startswith("#") and not _in_block_with_reason(
                    lines, n.lineno - 1):
                silent.append(f"{p.relative_to(PKG.parent)}:{n.lineno} {here.strip()}")
    assert not silent, silent


def _in_block_with_reason(lines: list[str], i: int) -> bool:
    """Line i follows other imports whose block starts under a comment."""
    j = i
    while j > 0 and lines[j - 1].strip().startswith(("import ", "from ")):
        j -= 1
    return j < i and lines[j - 1].strip().startswith("#") if j > 0 else False
