"""`parity audit --locate` on a real model: where the gap comes from, and what the pass costs.

    python -m bench.locate                  # SmolLM2-135M, parity's engine and vLLM, bf16 and fp16
    python -m bench.locate --settings hf:bf16:fp32 --samples 16 --json ''    # a quick look

Each setting (engine:engine dtype:trainer dtype) is audited twice on the same prompts, seed and
completions, without and with `--locate`, each audit in a fresh process, alternating; every
run's audit keeps its directory under `--out` (report.html with the plot). Tables:

- `cost`: the audit's own seconds without and with the pass, and the pass's two parts;
- `self_gap`: the trainer against itself beside mean |β| (docs/diagnostics.md);
- `findings`: per setting, the op named (where the engine's error rises above precision's), the
  first bit-level difference, and at the logits the sampled tokens' |Δℓ| and the KL;
- `layers-<engine>-<dtype>-<trainer>`: every decoder layer's residual stream and every op of
  layer 0 and of the named op's layer, median relative error of each comparison, prefill and
  decode.

Absolute seconds drift on a shared machine; compare the rows of one run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.report import Table, json_option, publish
from parity.models import trace

COMPARED = ("engine", "precision", "engine_vs_precision", "decode", "decode_vs_prefill")


def _audit(kw: dict[str, Any], out: str) -> dict[str, Any]:
    """One audit in this (fresh) process; audit.json's content."""
    from parity.audit.command import audit
    from parity.config import AuditSettings
    return audit(AuditSettings(**kw).validate(), Path(out))


def run(kw: dict[str, Any], out: Path) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(_audit, kw, str(out)).result()


def settings(value: str) -> list[tuple[str, str, str]]:
    out = []
    for item in value.split(","):
        parts = item.split(":")
        if len(parts) != 3:
            raise argparse.ArgumentTypeError(f"{item!r}: give engine:engine_dtype:trainer_dtype")
        out.append(tuple(parts))
    return out


def _g(v: float | None) -> float | None:
    return None if v is None else float(v)


def tables(results: dict[tuple[str, str, str], dict[str, list[dict[str, Any]]]]
           ) -> list[Table]:
    cost = Table("cost", "What --locate adds to an audit (mean over rounds)",
                 [("engine", None), ("engine dtype", None), ("trainer", None),
                  ("audit s", "{:.1f}"), ("with --locate s", "{:.1f}"), ("added", "{:.0%}"),
                  ("trainer against itself s", "{:.1f}"), ("located s", "{:.1f}")])
    gap = Table("self_gap", "The trainer against itself, beside mean |β| (the first round)",
                [("engine", None), ("engine dtype", None), ("trainer", None),
                 ("mean |β|", "{:.3g}"), ("forward", None), ("change", None),
                 ("mean |Δℓ|", "{:.3g}"), ("share |Δℓ| > 0.1", "{:.2%}"), ("max |Δℓ|", "{:.3g}")])
    find = Table("findings", "Where the engine's kernels matter: the first point where its error "
                 "rises above precision's by 2x (parity/audit/finding.py)",
                 [("engine", None), ("engine dtype", None), ("trainer", None),
                  ("named", None), ("op", None), ("pass", None), ("ratio", "{:.3g}"),
                  ("95% above", "{:.3g}"), ("first bit-level difference", None),
                  ("mean |Δℓ| engine", "{:.2g}"), ("mean |Δℓ| precision", "{:.2g}"),
                  ("KL engine", "{:.2g}"), ("KL decode", "{:.2g}")])
    layer_tables = []
    for (eng, dt, tr), runs in results.items():
        plain, located = runs["plain"], runs["locate"]
        mean = lambda xs: sum(xs) / len(xs)   # noqa: E731
        with_s = mean([r["seconds"] for r in located])
        parts = [r["locate"]["seconds"] for r in located]
        base = mean([r["seconds"] for r in plain])
        cost.add(eng, dt, tr, base, with_s, with_s / base - 1,
                 mean([p["self_gap"] for p in parts]), mean([p["layers"] for p in parts]))
        first = located[0]
        beta = first["metrics"].get("mismatch/beta_abs_mean")
        for row in first["locate"]["self_gap"]:
            gap.add(eng, dt, tr, beta, f"{row['forward']} ({row['dtype']})", row["change"],
                    row["abs_mean"], row["frac_outside"], row["abs_max"])
        lay = first["locate"]["layers"]
        pts, cur, named = lay["points"], lay["curves"], lay["named"] or {}
        at = lambda c, k, lg=lay["logits"]: lg.get(c, {}).get(k)   # noqa: E731
        find.add(eng, dt, tr, named.get("point", "none"), named.get("op", "—"),
                 named.get("pass", "—"), named.get("ratio"), named.get("low"),
                 lay["first_difference"] or "none", at("engine", "abs_dlogp_mean"),
                 at("precision", "abs_dlogp_mean"), at("engine", "kl_mean"),
                 at("decode", "kl_mean"))
        find.notes.append(f"{eng} {dt} against a {tr} trainer: {lay['finding']}")
        t = Table(f"layers-{eng}-{dt}-{tr}", f"{eng} in {dt} against a {tr} trainer: median "
                  f"relative error of the residual stream, every op of layer 0 and of the "
                  f"named op's layer, {lay['sequences']} sequences, {lay['tokens']} tokens "
                  f"(decode: their last tokens)",
                  [("point", None), *((c, "{:.2g}") for c in COMPARED)])
        shown = {"layers.0."} | ({f"layers.{trace.layer_of(named['point'])}."}
                                 if trace.layer_of(named.get("point", "embed")) is not None
                                 else set())
        for j, p in enumerate(pts):
            if p.endswith(".output") or p in ("embed", "final_norm", "logits") \
                    or any(p.startswith(x) for x in shown):
                t.add(p, *(_g(cur[c]["median"][j]) if c in cur else None for c in COMPARED))
        layer_tables.append(t)
    return [cost, gap, find, *layer_tables]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="neg-length-chat")
    ap.add_argument("--settings", type=settings,
                    default="hf:bf16:fp32,hf:fp16:fp32,vllm:bf16:fp32,vllm:fp16:fp32,hf:bf16:bf16",
                    help="engine:engine_dtype:trainer_dtype, comma-separated")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--locate-sequences", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each audit, alternating")
    ap.add_argument("--out", default=None, help="where the audits go (default: a temporary "
                    "directory)")
    json_option(ap, "locate")
    a = ap.parse_args()
    root = Path(a.out or tempfile.mkdtemp(prefix="bench-locate-"))
    results: dict[tuple[str, str, str], dict[str, list[dict[str, Any]]]] = {}
    for rnd in range(a.rounds):
        for eng, dt, tr in a.settings:
            for mode in ("plain", "locate"):
                kw = dict(model=a.model, task=a.task, engine=eng, engine_dtype=dt,
                          trainer_dtype=tr, samples=a.samples, progress=False,
                          locate=mode == "locate", locate_sequences=a.locate_sequences)
                out = root / f"{eng}-{dt}-{tr}-{mode}-{rnd}"
                res = run(kw, out)
                results.setdefault((eng, dt, tr), {}).setdefault(mode, []).append(res)
                print(f"{eng} {dt} / {tr} {mode} round {rnd}: {res['seconds']:.1f} s ({out})",
                      flush=True)
    publish("locate", tables(results), a)


if __name__ == "__main__":
    main()
