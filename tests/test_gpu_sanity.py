"""scripts/gpu_sanity.py: the command each run gets, and the judge on hand-made metrics.jsonl
files (truncation to the common steps, the window, verdicts computed by hand here)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from parity import metric_names as mn
from parity.cli import build_parser, config_from_args
from parity.experiments import claims as C

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_sanity", ROOT / "scripts/gpu_sanity.py")
S = importlib.util.module_from_spec(spec)
spec.loader.exec_module(S)


def _run(out: Path, name: str, lengths: list[float], kl_first: float = 1e-4,
         kl_last: float = 1e-4) -> None:
    d = out / name
    d.mkdir(parents=True)
    rows = [{mn.STEP: i + 1, mn.LEN_MEAN: x, mn.KL_K3: kl_first if i == 0 else kl_last,
             mn.BETA_ABS_MEAN: 0.01, mn.CLIP_FRAC: 0.002, mn.EOS_FRAC: 1.0, mn.STEP_S: 1.5}
            for i, x in enumerate(lengths)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _launch(out: Path, argv: list[str], runs: list[tuple[str, int, bool]]) -> None:
    a = S.parse(argv)
    (out / "launch.json").write_text(json.dumps(
        {"command": ["scripts/gpu_sanity.py", *argv], "args": vars(a),
         "runs": [{"recipe": r, "seed": s, "rc": 0 if started else None, "wall_s": 60.0,
                   "stopped": False, "started": started} for r, s, started in runs]}))


def _drops(out: Path, drops: dict[str, list[float]], steps: int = 30) -> None:
    """Runs whose length is 40 for the first half of their steps and 40 − drop after: with a
    window of 3 steps at each end, the drop is exactly `drop`."""
    runs = []
    for recipe, ds in drops.items():
        for seed, d in enumerate(ds):
            half = steps // 2
            _run(out, f"{recipe}-s{seed}", [40.0] * half + [40.0 - d] * (steps - half),
                 kl_first=1e-4, kl_last=2e-4 if recipe == "bf16-engine" else 1e-4)
            runs.append((recipe, seed, True))
    _launch(out, ["--steps", str(steps), "--seeds", "0", "1", "2"], runs)


def _verdicts(result: dict) -> dict[str, str]:
    return {c["id"]: c["verdict"] for c in result["claims"]}


def test_each_run_gets_flags_parity_train_has():
    a = S.parse(["--seeds", "0"])
    for recipe in S.RECIPES:
        cmd = S.command(a, S.Run(recipe, 0, Path("/tmp/x")), threads=1)
        assert cmd[1:4] == ["-m", "parity", "train"]
        c = config_from_args(build_parser().parse_args(cmd[3:]))
        assert (c.task, c.model, c.engine, c.device) == ("neg-length-chat", "smollm2-135m",
                                                         "vllm", "cuda")
        assert (c.steps, c.lr, c.eps_low, c.eps_high) == (200, 1e-6, 0.2, 0.2)
        assert (c.prompts_per_step, c.samples_per_prompt, c.max_new_tokens) == (16, 8, 64)
        assert (c.vllm_gpu_memory, c.save_every, c.micro_batch) == (0.05, 0, 8)
        assert (c.progress, c.report_to) == (False, "none")
        assert c.vllm_cuda_graphs is True
    scored = S.command(a, S.Run("bf16-shadow-scored", 0, Path("/tmp/x")), threads=1)
    c = config_from_args(build_parser().parse_args(scored[3:]))
    assert (c.recipe, c.shadow_kernels, c.ratio_source) == ("bf16-shadow", "scored", "shadow")
    eager = S.command(S.parse(["--no-vllm-cuda-graphs"]), S.Run("fp32", 0, Path("/tmp/x")), 1)
    assert config_from_args(build_parser().parse_args(eager[3:])).vllm_cuda_graphs is False


def test_a_lagging_bf16_engine_and_a_scored_shadow_like_fp32_hold(tmp_path):
    # By hand: bf16-engine 3 against fp32 11, pooled SD 1 on 4 degrees of freedom, so the 95%
    # interval is ±2.78·1·√(2/3) = ±2.27: bf16-engine lags (−8). The scored shadow, 11.5, is
    # +8.5 from bf16-engine and +0.5 from fp32: like fp32. fp16 is fp32's mean exactly.
    _drops(tmp_path, {"fp32": [10.0, 11.0, 12.0], "bf16-engine": [2.0, 3.0, 4.0],
                      "fp16": [10.0, 12.0, 11.0], "bf16-shadow-scored": [10.5, 11.5, 12.5]})
    result = S.judge(tmp_path)
    assert result["workload"]["steps_reached"] == 30 and result["workload"]["window"] == 3
    assert [r["stats"]["drop"] for r in result["runs"] if r["recipe"] == "fp32"] == [10, 11, 12]
    assert _verdicts(result) == {"R4": C.HOLDS, "R5s": C.HOLDS, "R6": C.HOLDS, "R7": C.HOLDS}
    r5s = next(c for c in result["claims"] if c["id"] == "R5s")
    assert abs(r5s["measured"]["scored_minus_bf16_engine"] - 8.5) < 1e-9
    assert abs(r5s["measured"]["interval_95_fp32"] - 2.78 * (2 / 3) ** 0.5) < 1e-9
    sp = result["spread"]
    assert abs(sp["recipes"]["fp32"]["sd"] - 1.0) < 1e-9
    assert sp["fp32_minus_bf16_engine"] == 8.0 and sp["spread_smaller_than_difference"]
    md = (tmp_path / "claims.md").read_text()
    assert "| R5s | bf16-shadow with the engine-scored shadow trains like fp32 |" in md
    assert "| fp32 | 0 | 0 | 30 | 40.0 | 30.0 | +10.0 |" in md
    assert "is smaller than the fp32 − bf16-engine difference" in md
    assert (tmp_path / "plots" / "sweep.png").is_file()


def test_a_difference_within_the_seed_spread_is_not_measurable(tmp_path):
    # By hand: fp32 6 ± SD 4, bf16-engine 5 ± SD 4: the interval (±2.78·4·√(2/3) = ±9.1)
    # holds the difference of 1, so nothing lags and there is nothing for the shadow to restore.
    _drops(tmp_path, {"fp32": [10.0, 2.0, 6.0], "bf16-engine": [5.0, 9.0, 1.0],
                      "fp16": [6.0, 6.0, 7.0], "bf16-shadow-scored": [11.0, 12.0, 13.0]})
    result = S.judge(tmp_path)
    v = _verdicts(result)
    assert v["R4"] == v["R5s"] == v["R6"] == C.NOT_MEASURABLE
    r5s = next(c for c in result["claims"] if c["id"] == "R5s")
    assert "does not lag fp32" in r5s["reason"]
    assert result["spread"]["spread_smaller_than_difference"] is False
    assert "is not smaller than" in (tmp_path / "claims.md").read_text()


def test_runs_are_truncated_to_the_steps_every_judged_run_reached(tmp_path):
    # Length 50 − step: over the first 20 steps, window 3, the drop is (49+48+47)/3 − (32+31+30)/3
    # = 17; the 30-step run untruncated would give 27.
    def lengths(n: int) -> list[float]:
        return [50.0 - s for s in range(1, n + 1)]
    for name, n in (("fp32-s0", 30), ("fp32-s1", 20), ("bf16-engine-s0", 25),
                    ("bf16-engine-s1", 2)):
        _run(tmp_path, name, lengths(n))
    (tmp_path / "bf16-shadow-scored-s0").mkdir()            # started, nothing recorded
    (tmp_path / "bf16-shadow-scored-s0" / "metrics.jsonl").write_text("")
    _launch(tmp_path, ["--steps", "30"],
            [("fp32", 0, True), ("fp32", 1, True), ("bf16-engine", 0, True),
             ("bf16-engine", 1, True), ("bf16-shadow-scored", 0, True), ("fp16", 0, False)])
    result = S.judge(tmp_path)
    w = result["workload"]
    assert (w["steps_reached"], w["window"], w["least_steps"]) == (20, 3, 3)
    judged = {f"{r['recipe']}-s{r['seed']}": r for r in result["runs"]}
    for name in ("fp32-s0", "fp32-s1", "bf16-engine-s0"):
        assert judged[name]["stats"]["steps"] == 20
        assert abs(judged[name]["stats"]["drop"] - 17.0) < 1e-9
    assert judged["bf16-engine-s1"]["dropped"] == "2 steps, fewer than the 3 a run needs (rc 0)"
    assert judged["bf16-shadow-scored-s0"]["dropped"].startswith("no step recorded")
    assert judged["fp16-s0"]["dropped"].startswith("never started")
    md = (tmp_path / "claims.md").read_text()
    assert "Dropped: " in md and "bf16-engine-s1: 2 steps" in md
    assert "every run judged reached 20 and is truncated to them" in md


def test_the_window_fits_runs_a_deadline_cut_short():
    assert S.window_for(200, None, None) == (20, 20)
    assert S.window_for(80, 45, None) == (8, 8)       # a tenth of what the longest run reached
    assert S.window_for(200, 150, None) == (20, 20)
    assert S.window_for(200, 30, None) == (20, 15)    # first and last 15 steps do not overlap
    assert S.window_for(20, 20, None) == (3, 3)
    assert S.window_for(20, 20, 5) == (5, 5)
    assert S.common_steps({"a": 30, "b": 19, "c": 25}, 20) == (
        25, {"b": "19 steps, fewer than the 20 a run needs"})


# A stand-in for `parity train`: records a step every 0.1 s until SIGINT, as parity's trainer
# does; "swallow" loses its first SIGINT (as one raised inside a __del__ is lost), "deaf"
# ignores SIGINT, "done" finishes 5 steps on its own.
FAKE = """
import json, os, signal, sys, time
mode, d = sys.argv[1], sys.argv[2]
os.makedirs(d, exist_ok=True)
hits = []
def on_int(signum, frame):
    hits.append(signum)
    if mode != "swallow" or len(hits) > 1:
        raise KeyboardInterrupt
signal.signal(signal.SIGINT, signal.SIG_IGN if mode == "deaf" else on_int)
try:
    with open(os.path.join(d, "metrics.jsonl"), "w", buffering=1) as f:
        for step in range(1, 6 if mode == "done" else 10 ** 6):
            f.write(json.dumps({"step": step, "completion/len_mean": 10.0}) + "\\n")
            time.sleep(0.1)
except KeyboardInterrupt:
    sys.exit(130)
"""
MODES = {"fp32": "done", "bf16-engine": "swallow", "fp16": "deaf",
         "bf16-shadow-scored": "interruptible"}


def test_the_deadline_interrupts_again_a_run_that_trains_on_and_kills_a_deaf_one(
        tmp_path, monkeypatch, capsys):
    import parity.testbed
    monkeypatch.setattr(parity.testbed, "resolve_model", lambda name: Path(name))
    monkeypatch.setattr(S, "command", lambda a, run, threads: [
        sys.executable, "-c", FAKE, MODES[run.recipe], str(run.dir)])
    out = tmp_path / "sanity"
    argv = ["scripts/gpu_sanity.py", "--seeds", "0", "--steps", "30", "--deadline-s", "2",
            "--grace-s", "1", "--stagger-s", "0.1", "--progress-s", "1", "--out", str(out)]
    assert S.main(argv) == 0
    said = capsys.readouterr().out
    runs = {r["recipe"]: r for r in json.loads((out / "launch.json").read_text())["runs"]}
    assert runs["fp32"]["rc"] == 0 and not runs["fp32"]["stopped"]
    assert runs["bf16-engine"]["rc"] == 130 and "SIGINT again to bf16-engine-s0" in said
    assert runs["bf16-shadow-scored"]["rc"] == 130
    assert runs["fp16"]["rc"] == -9 and "SIGKILL to fp16-s0" in said
    assert "deadline at 2 s: SIGINT to 3 runs" in said and ", steps: fp32-s0 5" in said
    judged = json.loads((out / "runs.json").read_text())
    assert judged["workload"]["steps_reached"] == 5          # fp32's 5 steps: all truncated
    assert all(r["stats"]["steps"] == 5 for r in judged["runs"])
    assert (out / "claims.md").is_file()
