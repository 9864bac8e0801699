"""Audit inputs: another system's completions and engine log-probs, and prompt files.

The audit input schema (docs/design.md), JSONL or parquet, one row per completion:
`prompt_token_ids`, `completion_token_ids`, `engine_logprobs` (one per completion token), optional
`advantage` or `reward`, and for a mixture of experts optional `routed_experts`: the experts the
engine chose, [tokens, MoE layers, top-k] over the prompt and completion tokens in order (as
vLLM's `CompletionOutput.routed_experts`; the last token may be left out, as no forward fed
it). A JSONL file may instead hold a serving engine's saved responses, which
`parity.audit.responses` turns into such rows. Every problem is refused with the file, row (and
line), column and what is wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from parity.audit.responses import is_server_line, server_rows
from parity.errors import ParityError
from parity.files import arrow_rows, exists, json_lines, lines, read_parquet, read_text
from parity.logprobs import Rollout, left_pad
from parity.models import routing
from parity.runs.finite import above_log_prob
from parity.tasks import load_rows
from parity.tasks.rewards import REWARD_LIMIT

REQUIRED = ("prompt_token_ids", "completion_token_ids", "engine_logprobs")
FLOAT32_MAX = 3.4028234663852886e38


def read_rollouts(path: str | Path, vocab_size: int, tok: Any = None) -> list[dict[str, Any]]:
    """Read and check an audit input file; every problem names its row and column. `tok`
    tokenizes where a server's saved response gives text only (audit.responses)."""
    p = Path(path)
    if p.suffix == ".parquet":
        table = read_parquet(p, "rollouts file")
        missing = [c for c in REQUIRED if c not in table.column_names]
        if missing:
            raise ParityError(f"{p}: missing column {missing[0]!r} (an audit file needs "
                              f"{', '.join(REQUIRED)}; it has {', '.join(table.column_names)})")
        rows = arrow_rows(table, str(p))
        where = [f"{p} row {i}" for i in range(len(rows))]
    elif p.suffix in (".jsonl", ".json"):
        rows, where = [], []
        for n, row in json_lines(p, "rollouts file"):
            if not isinstance(row, dict):
                raise ParityError(f"{p} line {n}: a row must be a JSON object")
            if is_server_line(row):
                for k, r in enumerate(server_rows(row, f"{p} line {n}", tok)):
                    rows.append(r)
                    where.append(f"{p} line {n}, choice {k}")
                continue
            rows.append(row)
            where.append(f"{p} row {len(rows) - 1} (line {n})")
    else:
        raise ParityError(f"rollouts file {p} must be .jsonl or .parquet")
    if not rows:
        raise ParityError(f"rollouts file {p} has no rows")
    for row, at in zip(rows, where):
        _check_row(row, at, vocab_size)
    return rows


def _check_row(row: dict[str, Any], at: str, vocab_size: int) -> None:
    for c in REQUIRED:
        if row.get(c) is None:
            raise ParityError(f"{at}: missing column {c!r}")
    for c in ("prompt_token_ids", "completion_token_ids"):
        ids = row[c]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                for t in ids):
            raise ParityError(f"{at}, column {c!r}: must be a list of integer token ids")
        if not ids:
            what = "empty completion" if c == "completion_token_ids" else "empty prompt"
            raise ParityError(f"{at}, column {c!r}: {what}")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ParityError(f"{at}, column {c!r}: token id {_show(bad[0])} is outside the "
                              f"model's vocabulary (0..{vocab_size - 1})")
    lp = row["engine_logprobs"]
    if not isinstance(lp, list) or not all(isinstance(v, (int, float)) and
                                           not isinstance(v, bool) for v in lp):
        raise ParityError(f"{at}, column 'engine_logprobs': must be a list of numbers")
    n = len(row["completion_token_ids"])
    if len(lp) != n:
        raise ParityError(f"{at}, column 'engine_logprobs': {len(lp)} values for {n} completion "
                          f"tokens (one log-prob per completion token)")
    for t, v in enumerate(lp):
        # A NaN or inf (a float beyond float32 is one there, where log-probs are computed) is
        # left out of every figure and counted (audit/command.py); an integer no float holds is
        # no engine's log-prob. A positive one (training's rule, `above_log_prob`) is refused,
        # where a run in flight leaves it out: a file can be fixed before its audit.
        if isinstance(v, int) and not _finite(v, FLOAT32_MAX):
            raise ParityError(f"{at}, column 'engine_logprobs': {_show(v)} at token {t} is not "
                              f"a log-probability")
        if _finite(v, FLOAT32_MAX) and above_log_prob(v):
            raise ParityError(f"{at}, column 'engine_logprobs': {v} at token {t} is positive; "
                              f"a log-probability is <= 0")
    for c in ("advantage", "reward"):
        v = row.get(c)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                  and _finite(v, REWARD_LIMIT)):
            raise ParityError(f"{at}, column {c!r}: must be a finite number within "
                              f"+-{REWARD_LIMIT:g}, got {_show(v)}")


def _show(v: Any) -> str:
    """A value for a message, short: a 400-digit integer is not spelled out."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
        return f"an integer of {v.bit_length()} bits"
    if isinstance(v, float):
        return f"{v:g}"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _finite(v: float, limit: float) -> bool:
    """|v| <= limit; False for NaN, and for an integer too large to be a float at all."""
    try:
        return abs(float(v)) <= limit
    except OverflowError:
        return False


def rollout_advantages(rows: list[dict[str, Any]]) -> torch.Tensor | None:
    """`advantage` as given; else `reward` centred and scaled within each group of identical
    prompts (GRPO); else None (no advantages: clip fractions count both signs)."""
    if all(r.get("advantage") is not None for r in rows):
        return torch.tensor([float(r["advantage"]) for r in rows], device="cpu")
    if not all(r.get("reward") is not None for r in rows):
        return None
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(tuple(r["prompt_token_ids"]), []).append(i)
    adv = torch.zeros(len(rows), device="cpu")
    for idx in groups.values():
        if len(idx) > 1:
            rw = torch.tensor([float(rows[i]["reward"]) for i in idx], dtype=torch.float64,
                              device="cpu")
            adv[idx] = ((rw - rw.mean()) / (rw.std() + 1e-4)).float()
    return adv


ROUTED = "routed_experts"


def check_routing(rows: list[dict[str, Any]], where: str, model: torch.nn.Module) -> None:
    """`routed_experts`, where a row has it: every row has it, the model is a mixture of
    experts, and each row's record is [tokens, layers, top-k] of expert ids for this model."""
    given = [i for i, r in enumerate(rows) if r.get(ROUTED) is not None]
    if not given:
        return
    if len(given) < len(rows):
        i = next(i for i, r in enumerate(rows) if r.get(ROUTED) is None)
        raise ParityError(f"{where} row {i}: no {ROUTED!r}, which row {given[0]} has: give "
                          f"every row's routing or none")
    if not routing.is_moe(model):
        raise ParityError(f"{where}: column {ROUTED!r} given, but the model has no "
                          f"mixture-of-experts layers")
    L, E, k = routing.shape(model)
    for i, r in enumerate(rows):
        at = f"{where} row {i}, column {ROUTED!r}"
        rec, n = r[ROUTED], len(r["prompt_token_ids"]) + len(r["completion_token_ids"])
        if not (isinstance(rec, list) and len(rec) in (n - 1, n)):
            raise ParityError(f"{at}: {len(rec) if isinstance(rec, list) else 'no list of'} "
                              f"tokens for a prompt and completion of {n} (one entry per "
                              f"token, the last one may be left out)")
        for t, layers in enumerate(rec):
            if not (isinstance(layers, list) and len(layers) == L and all(
                    isinstance(ids, list) and len(ids) == k and all(
                        isinstance(e, int) and not isinstance(e, bool) and 0 <= e < E
                        for e in ids) for ids in layers)):
                raise ParityError(f"{at}: token {t} must hold {L} layers of {k} expert ids "
                                  f"in 0..{E - 1} (this model's), got {_show(layers)}")


def to_rollout(rows: list[dict[str, Any]], pad_id: int, eos_id: int, experts: int = 0
               ) -> Rollout:
    """The rows as a Rollout; with `routed_experts` (checked by `check_routing`) and the
    model's expert count, its `routed` record, the unknown mark where a row gives none."""
    ids, mask = left_pad([r["prompt_token_ids"] for r in rows], pad_id)
    T = max(len(r["completion_token_ids"]) for r in rows)
    comp = torch.full((len(rows), T), pad_id, dtype=torch.long, device="cpu")
    cmask = torch.zeros((len(rows), T), device="cpu")
    lp = torch.zeros((len(rows), T), device="cpu")
    for i, r in enumerate(rows):
        n = len(r["completion_token_ids"])
        comp[i, :n] = torch.tensor(r["completion_token_ids"], device="cpu")
        cmask[i, :n] = 1
        lp[i, :n] = torch.tensor(r["engine_logprobs"], dtype=torch.float32, device="cpu")
    finished = torch.tensor([r["completion_token_ids"][-1] == eos_id for r in rows],
                            device="cpu")
    out = Rollout(ids, mask, comp, cmask, lp, finished)
    if experts and rows[0].get(ROUTED) is not None:
        P = ids.shape[1]
        L, k = len(rows[0][ROUTED][0]), len(rows[0][ROUTED][0][0])
        out.routed = torch.full((len(rows), P + T, L, k), routing.unknown(experts),
                                dtype=routing.id_dtype(experts), device="cpu")
        for i, r in enumerate(rows):   # position p of a prompt of n tokens is column p + P - n
            a = P - len(r["prompt_token_ids"])
            rec = torch.tensor(r[ROUTED], dtype=out.routed.dtype)
            out.routed[i, a:a + len(rec)] = rec
    return out


def read_prompts(path: str) -> list[str | list[dict]]:
    p = Path(path)
    if not exists(p, "prompts file"):
        raise ParityError(f"prompts file {p} does not exist")
    if p.suffix == ".txt":
        prompts = [line for line in lines(read_text(p, "prompts file")) if line.strip()]
        if not prompts:
            raise ParityError(f"prompts file {p} has no non-empty lines")
        return prompts
    return [r["prompt"] for r in load_rows(str(p))]
