"""The audit's measurement: α/β, clip attribution, KLs and per-token columns accumulated over
its batches (`Measurement`), and with `--locate` the trainer against itself and the sequences
traced (parity/audit/locate.py)."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import torch

from parity import metric_names as mn
from parity.audit.locate import SelfGap, locate, sequences_of
from parity.config import AuditSettings
from parity.config.certificate import log_mean_exp
from parity.diagnostics import (
    EPS_SWEEP,
    Shadow,
    StepDiagnostics,
    clip_fractions,
    dump_table,
    exact_kl_of_rows,
    kept_rows,
    measure,
)
from parity.engines import Engine
from parity.logprobs import Rollout, Sampling
from parity.models import routing
from parity.models.forward import score_full
from parity.models.precision import trainer_precision
from parity.runs.finite import LeftOutTally, usable_tokens
from parity.runs.routing_gap import Tally


def _warning(message: str) -> None:
    print(f"parity: warning: {message}", file=sys.stderr)


@dataclasses.dataclass
class Attributed:
    """What a batch's routing figures need of its attribution, [B, T]."""
    beta: torch.Tensor
    phantom: torch.Tensor
    mask: torch.Tensor      # the tokens counted (non-finite and positive log-probs left out)


class Measurement:
    """Accumulates α/β, clip attribution, KLs and per-token columns over the audit's batches."""

    def __init__(self, a: AuditSettings, device: torch.device):
        self.a, self.device, self.diag, self.tables = a, device, StepDiagnostics(), []
        self.adv: list[torch.Tensor] = []
        self.has_adv = True
        self.cols: dict[str, list[torch.Tensor]] = {k: [] for k in (
            "engine_logprob", "trainer_logprob", "shadow_logprob", "position")}
        self.seq_len: list[torch.Tensor] = []
        self.seq_lr: list[torch.Tensor] = []
        self.left_out = LeftOutTally("the engine (l_mu) or the trainer's forwards")
        # --locate: the trainer against itself on the first batch, and the sequences traced
        self.self_gap = SelfGap(a.trainer_dtype, a.engine_dtype) if a.locate else None
        self.traced: list[tuple[list[int], int]] = []   # (prompt and completion, its start)
        self.layers: dict[str, Any] | None = None
        self.locate_s = {"self_gap": 0.0, "layers": 0.0}
        self.routing = Tally()   # a mixture of experts whose engine recorded its routing

    @torch.no_grad()
    def add(self, model: torch.nn.Module, shadow: Shadow, r: Rollout, adv: torch.Tensor | None,
            s: Sampling, prompt_ids: torch.Tensor, first_sample: int) -> None:
        a, dev = self.a, self.device
        r, prompt_ids = r.to(dev), prompt_ids.to(dev)
        # The trainer routes for itself (the audit measures the gap, it replays nothing); its
        # own choice is recorded where the engine's was.
        routed, r = r.routed, dataclasses.replace(r, routed=None)
        with trainer_precision(a.trainer_dtype, dev, a.cpu_fp16, a.kernels, model), \
                routing.recording(model) as rec:
            rows = kept_rows(r, slice(0, len(r.completion_ids)))
            sc = score_full(model, r, s, keep_logits=rows, chunk=a.logprob_chunk)
            logp_pi, logits = sc.logp, sc.logits
        own = (rec.ids(len(r.completion_ids)), rec.margins(len(r.completion_ids))) \
            if routed is not None and rec.layers else None
        logp_s = shadow.logprobs(model, r, s, logp_pi)
        if self.self_gap is not None and not self.self_gap.pairs:   # the first batch
            t0 = time.perf_counter()
            self.traced = list(sequences_of(r, r.completion_mask, a.locate_sequences))
            self.self_gap.add(model, shadow, r, s, logp_pi, logp_s, r.completion_mask,
                              a.cpu_fp16, a.logprob_chunk, a.locate_rows, a.kernels)
            self.locate_s["self_gap"] = time.perf_counter() - t0
        att = self.add_scored(r, logp_pi, logp_s, logits, rows, adv, s, prompt_ids,
                              first_sample)
        if own is not None:
            self.routing.add(routed, own[0], own[1], r.prompt_mask, att.mask,
                             routing.shape(model)[1], att.beta, att.phantom, logp_pi,
                             r.engine_logprobs)

    def add_scored(self, r: Rollout, logp_pi: torch.Tensor, logp_s: torch.Tensor,
                   logits: torch.Tensor | None, rows: list[int], adv: torch.Tensor | None,
                   s: Sampling, prompt_ids: torch.Tensor, first_sample: int) -> Attributed:
        """A batch's figures from its scores: ℓ_π and ℓ_s of `r`'s tokens on this device, and the
        trainer's logits of `rows` (the rows whose distribution the engine kept). Returns the
        attribution and the tokens it counted."""
        a, dev = self.a, self.device
        self.has_adv &= adv is not None
        adv_t = adv.to(dev) if adv is not None else torch.zeros(len(r.completion_ids), device=dev)
        mask, (logp_pi, logp_s, mu), left_out = usable_tokens(r.completion_mask, logp_pi, logp_s,
                                                              r.engine_logprobs)
        self.left_out.add(left_out, _warning)
        r = dataclasses.replace(r, completion_mask=mask, engine_logprobs=mu)
        # What the engine's own ratio ℓ_π − ℓ_μ would clip at θ = θ_old.
        att = measure(self.diag, logp_pi, logp_s, r.engine_logprobs, adv_t, mask, a.eps, a.eps)
        if r.dists is not None:
            self.diag.add_exact_kl(exact_kl_of_rows(r, logits, rows, mask[rows], s))
        m = mask > 0
        self.adv.append(adv_t[:, None].expand_as(mask)[m].cpu())
        for k, v in (("engine_logprob", r.engine_logprobs), ("trainer_logprob", logp_pi),
                     ("shadow_logprob", logp_s),
                     ("position", torch.arange(mask.shape[1], device=dev).expand_as(mask))):
            self.cols[k].append(v[m].float().cpu())
        self.seq_len.append(mask.sum(-1).cpu())
        self.seq_lr.append(torch.where(m, logp_pi - r.engine_logprobs, 0.0).sum(-1).cpu())
        sample_ids = torch.arange(first_sample, first_sample + len(r.completion_ids), device=dev)
        self.tables.append(dump_table(0, len(self.tables), 0, sample_ids, prompt_ids, r, adv_t,
                                      logp_pi, logp_s, att, a.eps, a.eps))
        return Attributed(att.beta, att.phantom, mask)

    def trace(self, model: torch.nn.Module, engine: Engine | None, name: str) -> None:
        """--locate's layer-by-layer pass over the sequences kept by `add`."""
        if self.self_gap is not None:
            t0 = time.perf_counter()
            self.layers = locate(model, engine, self.a, [s for s, _ in self.traced], name,
                                 [start for _, start in self.traced], self.routing.by_layer())
            self.locate_s["layers"] = time.perf_counter() - t0

    def located(self) -> dict[str, Any]:
        """audit.json's `locate`: absent without --locate."""
        if self.self_gap is None:
            return {}
        return {"locate": {"self_gap": self.self_gap.results(),
                           "self_gap_note": self.self_gap.note, "layers": self.layers,
                           "seconds": self.locate_s}}

    def _gap(self) -> torch.Tensor:
        """|ℓ_π − ℓ_μ| of every measured token."""
        return (torch.cat(self.cols["trainer_logprob"])
                - torch.cat(self.cols["engine_logprob"])).abs()

    def log_exp_gap_mean(self) -> float | None:
        """log of the mean exp(|ℓ_π − ℓ_μ|) over the measured tokens (NeMo-RL's bar), in
        float64 and in log space: a gap past 709 nats overflows exp itself."""
        return log_mean_exp(self._gap())

    def results(self) -> dict[str, Any]:
        tok = self.diag.tokens()
        adv = torch.cat(self.adv) if self.has_adv else None
        metrics = self.diag.metrics()
        # Clip fractions at ε with the advantages' signs, or both signs when there are none.
        head = clip_fractions(tok["alpha"], tok["beta"], adv, self.a.eps, self.a.eps)
        metrics.update({mn.CLIP_FRAC: head["clip"], mn.PHANTOM_FRAC: head["phantom"],
                        mn.HIDDEN_FRAC: head["hidden"], mn.ALPHA_CLIP_FRAC: head["alpha"]})
        # The whole engine-trainer gap ℓ_π − ℓ_μ = α + β at θ = θ_old: with an engine whose
        # kernels are not the shadow's (a server) α is not ~0, and β alone leaves part of it out.
        # From ℓ_π and ℓ_μ themselves: α + β, each rounded, loses the digits they share when the
        # shadow is far from both.
        gap = self._gap()
        if gap.numel():     # none where every token was left out
            metrics.update({mn.LOG_RATIO_ABS_MEAN: float(gap.mean()),
                            mn.LOG_RATIO_ABS_MAX: float(gap.max())})
        metrics.update({k: n for k, n in self.left_out.total.counts().items() if n})
        metrics.update(self.routing.metrics())
        if adv is None:
            metrics.pop(mn.BETA_ADV_CORR, None)
            metrics.pop(mn.BETA_ADV_CORR_SE, None)
        sweep = []
        for eps in sorted(set(EPS_SWEEP) | {self.a.eps}):
            f = clip_fractions(tok["alpha"], tok["beta"], adv, eps, eps)
            sweep.append({"eps": eps, "clip_frac": f["clip"], "phantom_frac": f["phantom"],
                          "hidden_frac": f["hidden"], "alpha_frac": f["alpha"]})
        return {"metrics": metrics, "phantom_vs_eps": sweep, "advantages": adv is not None,
                "tokens": int(tok["beta"].numel()), "completions": int(sum(len(x) for x in
                                                                           self.seq_len))}

    def arrays(self) -> tuple[dict[str, Any], dict[str, Any]]:
        tokens = {k: torch.cat(v).numpy() for k, v in self.cols.items()}
        seqs = {"length": torch.cat(self.seq_len).numpy(),
                "log_ratio": torch.cat(self.seq_lr).numpy()}
        return tokens, seqs
