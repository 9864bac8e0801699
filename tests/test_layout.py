"""The architecture as README.md's module map draws it, checked on the source: data flows one way
(entry points → trainer → components), and no function grows past what one can read at once."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "parity"
# Who may run the trainer: the command line, the sweep (one training per worker).
TRAINER_USERS = {"cli", "sweep"}
# Components: the RL core and the measurements. They never reach up to a command.
COMPONENTS = {"config", "memory", "pretrained", "objectives", "precision", "engines", "scoring", "diagnostics",
              "metrics", "checkpoints", "distributed", "async_engine", "vllm_engine", "rollouts",
              "runs", "tasks", "arith", "testbed", "errors", "files", "ui", "loggers",
              "audit_inputs", "server_rollouts", "server_client", "devices", "lora"}
COMMANDS = {"cli", "trainer", "sweep", "reproduce", "reproduce_real", "audit", "server_audit",
            "fp16_check", "reports", "claims", "claims_real"}
MAX_LINES = 80


def modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(PKG).with_suffix("")).replace("/", "."): ast.parse(p.read_text())
            for p in PKG.rglob("*.py")}


def imported(tree: ast.Module) -> set[str]:
    """parity modules a file imports, anywhere in it (lazy imports included)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("parity"):
            parts = node.module.split(".")
            if len(parts) > 1:
                out.add(parts[1])
            else:
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("parity."))
    return out


def test_only_the_entry_points_import_the_trainer():
    users = {name for name, tree in modules().items() if "trainer" in imported(tree)}
    assert users <= TRAINER_USERS, users - TRAINER_USERS


def test_components_never_import_a_command():
    found = {(name, dep) for name, tree in modules().items() if name in COMPONENTS
             for dep in imported(tree) & COMMANDS}
    assert not found, found


def test_every_module_is_placed_in_the_map():
    names = {n.split(".")[0] for n in modules()} - {"__init__", "__main__", "integrations"}
    assert names <= COMPONENTS | COMMANDS, names - COMPONENTS - COMMANDS


def test_no_function_over_80_lines_without_a_stated_reason():
    """A longer function says why in a comment on the line above its `def` ("long: ...")."""
    long = []
    for p in PKG.rglob("*.py"):
        lines = p.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                reason = lines[first - 2].strip().startswith("# long:") if first > 1 else False
                if n > MAX_LINES and not reason:
                    long.append(f"{p.name}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long
