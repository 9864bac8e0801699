"""The objectives parity trains with: one registry entry each, holding its name, its loss on a
minibatch, what it needs (clip range, value head, reference, pairs) and how it is described.
Config validation, `--help`, `parity recipes`, README.md's table and the integrations' refusals
read the entry; the trainer and the diagnostics ask it what they would otherwise test a name
for. Adding an objective is its loss (here or in a module of its own) and one `register` call.

This module imports without torch, so that the command line starts, and refuses bad settings,
in a fraction of a second: the losses (parity/objectives/losses.py, each next to its equation
in docs/design.md's notation) are imported when one is first computed. Their helpers
(`log_ratio`, `grpo_advantages`, ...) are reachable from here as before.
"""

from __future__ import annotations

# Imports inside functions: this registry imports without torch (start-up time); the losses
# load at their first use.
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

from parity.registry import Registry

if TYPE_CHECKING:
    from parity.objectives.losses import Loss, Minibatch, Share

LossFn = Callable[[Any, "Minibatch", "Share"], "Loss"]


@dataclass(frozen=True, kw_only=True)
class Objective:
    name: str
    summary: str               # one line, for --help
    # The loss as README.md's table and `parity recipes` show it; `{field}` is Config's default.
    loss_text: str
    # loss(cfg, minibatch, share) -> Loss: `share(loss, n, unit)` turns a mean over this piece's
    # n items (tokens, sequences or pairs) into its share of the minibatch's mean (losses.py).
    loss: LossFn
    clip: Literal["token", "sequence"] | None  # eps_low/eps_high, seq_eps_low/seq_eps_high, none
    value_head: bool = False   # a learned V(s_t) and GAE advantages
    reference: bool = False    # reference log-probs (the frozen initial policy, or ℓ_μ)
    pairs: bool = False        # its loss is a mean over preference pairs, not tokens

    def clip_range(self, cfg: Any) -> tuple[float | None, float | None]:
        if self.clip == "token":
            return cfg.eps_low, cfg.eps_high
        if self.clip == "sequence":
            return cfg.seq_eps_low, cfg.seq_eps_high
        return None, None


OBJECTIVES: Registry[Objective] = Registry("objective")
register = OBJECTIVES.register


def _built_in(name: str) -> LossFn:
    """A loss of losses.py, imported at its first call (losses.py imports torch)."""
    def loss(cfg: Any, b: "Minibatch", share: "Share") -> "Loss":
        import parity.objectives.losses as losses
        return getattr(losses, name)(cfg, b, share)
    loss.__name__ = name
    return loss


register(Objective(
    name="ppo-clip", summary="token PPO-clip, GRPO group advantages", clip="token",
    loss=_built_in("loss_ppo_clip"),
    loss_text="−min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A) per token, GRPO group advantages, "
              "times the behaviour weight; `--loss-agg seq-mean` (GRPO), `token-mean` (DAPO), "
              "`token-sum` (Dr.GRPO: over B × max_new_tokens)"))
register(Objective(
    name="gspo", summary="GSPO: PPO-clip on the sequence's geometric-mean ratio, its own clip "
                         "range", clip="sequence",
    loss=_built_in("loss_gspo"),
    loss_text="the same on the sequence's geometric-mean ratio exp(mean_t log r), with its own "
              "clip range `seq_eps_low/high` ({seq_eps_low:g} / {seq_eps_high:g}); setting "
              "`eps_low/eps_high` with it is refused"))
register(Objective(
    name="pg-is", summary="REINFORCE with truncated sequence importance weights, no clip",
    clip=None, loss=_built_in("loss_pg_is"),
    loss_text="REINFORCE: −sg(min(ρ_i, C))·A_i·ℓ_π per token, ρ_i = exp(Σ_t log r), no clip "
              "(`pg_is/*` metrics)"))
register(Objective(
    name="ppo-value", summary="PPO-clip with a learned value head and GAE", clip="token",
    value_head=True, loss=_built_in("loss_ppo_value"),
    loss_text="PPO-clip with token advantages from GAE (`gae_gamma` {gae_gamma:g}, `gae_lambda` "
              "{gae_lambda:g}, whitened) and a zero-initialised linear value head on the last "
              "hidden state, clipped value loss × `value_coef` {value_coef:g}; saved as "
              "`value_head.safetensors` in each checkpoint"))
register(Objective(
    name="online-dpo", summary="best vs worst completion of each group as a DPO pair",
    clip=None, reference=True, pairs=True, loss=_built_in("loss_online_dpo"),
    loss_text="each group's best- and worst-rewarded completions as a pair, −log σ(b·margin) "
              "(b = `dpo_scale` {dpo_scale:g}); reference `initial` (the frozen starting "
              "policy) or `engine` (ℓ_μ stands in, so the precision gap enters the margin: "
              "`dpo/margin_beta`, `dpo/margin_beta_abs`)"))


def __getattr__(name: str) -> Any:
    """The losses' helpers (`log_ratio`, `Minibatch`, ...), imported with torch on first use."""
    if name.startswith("__"):
        raise AttributeError(name)
    # Not `from parity.objectives import losses`: that asks this function for `losses` first.
    import parity.objectives.losses as losses
    try:
        return getattr(losses, name)
    except AttributeError:
        raise AttributeError(f"module 'parity.objectives' has no attribute {name!r}") from None
