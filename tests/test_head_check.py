"""Chunked scoring proves itself: a model whose logits are not its head's output (Granite's
`logits_scaling`, or a scale under a name parity has never heard of) is found by comparing the
two on a few positions, said in one line at load, and scored from its own logits, as a float64
recomputation from those logits scores it; a plain model is scored in chunks, silently."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM

from parity.errors import ParityError
from parity.logprobs import Rollout, Sampling
from parity.models.forward import head_gives_logits, score_full, score_right_padded

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def granite(vocab: int = 64) -> GraniteForCausalLM:
    torch.manual_seed(0)
    return GraniteForCausalLM(GraniteConfig(**{**SMALL, "vocab_size": vocab},
                                            logits_scaling=8.0)).eval()


class HalvedLogits(LlamaForCausalLM):
    """A Llama that scales its logits after the head under no name a config carries."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out


def rollout() -> Rollout:
    g = torch.Generator().manual_seed(1)
    pm = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    cm = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1]])
    ids = torch.randint(2, 64, (2, 4), generator=g) * pm
    comp = torch.randint(2, 64, (2, 4), generator=g) * cm.long()
    return Rollout(ids, pm, comp, cm, torch.zeros(2, 4), torch.ones(2, dtype=torch.bool))


def by_hand(model, r: Rollout) -> torch.Tensor:
    """Each completion token's log-prob from the model's own logits, row by row, in float64."""
    out = torch.zeros(r.completion_ids.shape, dtype=torch.float64)
    for b in range(r.completion_ids.shape[0]):
        p = r.prompt_ids[b][r.prompt_mask[b] > 0].tolist()
        c = r.completion_ids[b][r.completion_mask[b] > 0].tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + c])).logits[0].double()
        lp = torch.log_softmax(logits, -1)
        out[b, :len(c)] = torch.stack([lp[len(p) - 1 + j, t] for j, t in enumerate(c)])
    return out


@pytest.mark.parametrize("make", [granite, lambda: HalvedLogits(LlamaConfig(**SMALL)).eval()],
                         ids=["granite logits_scaling", "a scale under no known name"])
def test_a_model_whose_logits_are_not_its_heads_is_scored_from_its_own(make, capsys):
    model = make()
    r = rollout()
    with torch.no_grad():
        got = score_full(model, r, Sampling()).logp
    want = by_hand(model, r)
    assert (got.double() - want).abs().max() < 1e-5
    # the head alone would have been far off: the check is what makes the default right
    assert not head_gives_logits(model)
    err = capsys.readouterr().err
    assert err.count("its logits are not its output projection's") == 1   # said once
    assert "scored from its own logits, whole (logprob_chunk=-1)" in err
    with pytest.raises(ParityError, match="transforms its logits after the output projection"):
        score_full(model, r, Sampling(), chunk=2)
    # --locate's right-padded layout scores it the same way
    with torch.no_grad():
        right = score_right_padded(model, r, Sampling())
    assert (right.double() - want).abs().max() < 1e-5


def test_a_plain_model_is_scored_from_its_head_in_chunks_silently(capsys):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    r = rollout()
    assert head_gives_logits(model)
    with torch.no_grad():
        chunked = score_full(model, r, Sampling(), chunk=2).logp
    assert (chunked.double() - by_hand(model, r)).abs().max() < 1e-5
    assert capsys.readouterr().err == ""


@pytest.mark.e2e
def test_the_check_runs_when_parity_loads_a_model(text_model, tmp_path, capfd):
    from parity.models.loading import load_policy
    _, tok = load_policy(text_model)
    capfd.readouterr()
    granite(len(tok)).save_pretrained(tmp_path)
    for f in text_model.glob("*token*"):
        shutil.copy(f, tmp_path)
    model, _ = load_policy(tmp_path)
    assert "GraniteForCausalLM: its logits are not its output projection's" in \
        capfd.readouterr().err
    assert model.__dict__["_parity_head_gives_logits"] is False
