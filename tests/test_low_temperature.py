"""ℓ_μ at low temperatures, for both engines, against a reference computed apart from them: a
plain transformers forward of the same fp32 weights over the sampled sequence, its logits in
float64, divided by T, log-softmaxed. vLLM samples every temperature in (0, 0.01) at 0.01 and
reports that distribution's log-probs, which the trainer would score at the temperature asked
for; parity refuses those temperatures for vLLM (and for a vLLM server) in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cli_helpers import assert_user_error
from parity.config import AuditSettings, make_config
from parity.engines import EngineNeeds, EngineSpec, check_engine, make_engine
from parity.errors import ParityError
from parity.logprobs import Sampling
from parity.models.loading import load_policy
from vllm_helpers import prompts_of

TEMPERATURES = (1e-6, 1e-4, 0.01, 1.0)
# fp32 logits of a cached decode and of one forward over the whole sequence agree to ~1e-5
# (measured 3e-5 at T = 0.01); T divides that. The wrong temperature puts ℓ_μ off by 0.02 to
# thousands, and at T <= 1e-4 the reference is ~0 for every token a near one-hot distribution
# samples, so that any error of size shows.
ATOL = 1e-3


def reference_logprobs(model: torch.nn.Module, r, T: float) -> torch.Tensor:
    """log softmax(z / T) of each completion token, z from one forward of the whole sequence,
    in float64; 0 past a row's end."""
    ids = torch.cat([r.prompt_ids, r.completion_ids], 1)
    mask = torch.cat([r.prompt_mask, r.completion_mask.long()], 1)
    with torch.no_grad():
        z = model(input_ids=ids, attention_mask=mask,
                  position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits.double()
    P = r.prompt_ids.shape[1]
    lp = torch.log_softmax(z[:, P - 1:-1] / T, -1).gather(-1, r.completion_ids[..., None])
    return lp.squeeze(-1) * r.completion_mask


def _sample(name: str, model, tok, model_dir, T: float):
    eng = make_engine(name, EngineSpec(model, str(model_dir), "fp32", [tok.eos_token_id],
                                       tok.pad_token_id, 0, 64, 8))
    try:
        eng.sync(model)
        return eng.generate(prompts_of(tok), 12, Sampling(T, 1.0, 0), torch.Generator()
                            .manual_seed(0))
    finally:
        eng.close()


@pytest.mark.e2e
@pytest.mark.parametrize("T", TEMPERATURES)
def test_hf_engine_logprobs_are_the_reference_at_every_temperature(text_model, T):
    model, tok = load_policy(text_model)
    model.eval()
    r = _sample("hf", model, tok, text_model, T)
    ref = reference_logprobs(model, r, T)
    assert r.completion_mask.sum() > 8 * 4
    torch.testing.assert_close(r.engine_logprobs.double() * r.completion_mask, ref, atol=ATOL,
                               rtol=0)


@pytest.mark.e2e
@pytest.mark.parametrize("T", TEMPERATURES)
def test_vllm_engine_logprobs_are_the_reference_or_the_temperature_is_refused(
        vllm_ready, text_model, T):
    model, tok = load_policy(text_model)
    model.eval()
    if T < 0.01:
        with pytest.raises(ParityError, match=f"temperature={T:g}: engine=vllm samples every "
                                              f"temperature below 0.01 at 0.01"):
            check_engine("vllm", model.config, EngineNeeds(temperature=T))
        return
    r = _sample("vllm", model, tok, text_model, T)
    ref = reference_logprobs(model, r, T)
    assert r.completion_mask.sum() > 8 * 4
    torch.testing.assert_close(r.engine_logprobs.double() * r.completion_mask, ref, atol=ATOL,
                               rtol=0)


def test_settings_refuse_temperatures_vllm_would_raise():
    for T in (1e-6, 1e-4, 0.0099):
        with pytest.raises(ParityError, match="engine=vllm samples every temperature below "
                                              "0.01 at 0.01.*or engine=hf"):
            make_config({"engine": "vllm", "temperature": T})
        with pytest.raises(ParityError, match="a vLLM server samples every temperature below"):
            AuditSettings(model="text-xs", task="neg-length", server="http://127.0.0.1:1",
                          temperature=T).validate()
        with pytest.raises(ParityError, match="engine=vllm samples every temperature below"):
            AuditSettings(model="text-xs", task="neg-length", engine="vllm",
                          temperature=T).validate()
        make_config({"engine": "hf", "temperature": T})
        AuditSettings(model="text-xs", task="neg-length", temperature=T).validate()
    make_config({"engine": "vllm", "temperature": 0.01})


@pytest.mark.e2e
def test_train_at_a_temperature_vllm_would_raise_is_one_line_and_leaves_nothing(tmp_path):
    p = subprocess.run([sys.executable, "-m", "parity", "train", "--engine", "vllm",
                        "--temperature", "1e-6", "--model", "text-xs", "--out",
                        str(tmp_path / "run")], capture_output=True, text=True, cwd=tmp_path)
    assert_user_error(p, "temperature=1e-06: engine=vllm", "use temperature >= 0.01")
    assert not (tmp_path / "run").exists()


# What vLLM would refuse, or fail on mid-run, is refused before a run directory exists.

@pytest.mark.e2e
def test_vllm_check_counts_the_position_scoring_asks_for(vllm_ready, text_model):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(text_model)
    limit = config.max_position_embeddings
    check_engine("vllm", config, EngineNeeds(max_len=limit))
    check_engine("vllm", config, EngineNeeds(max_len=limit - 1, scores=True))
    with pytest.raises(ParityError, match=f"plus the one position vLLM's scoring "
                                          f"\\(shadow_kernels=scored\\) asks for beyond them is "
                                          f"{limit + 1} tokens, beyond the model's {limit}"):
        check_engine("vllm", config, EngineNeeds(max_len=limit, scores=True))


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["head size 8", "unmerged lora", "kv cache variable"])
def test_what_vllm_cannot_run_is_one_line_before_the_run_directory(vllm_ready, text_model,
                                                                   tmp_path, case):
    import os
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM
    model, env, extra = str(text_model), dict(os.environ), []
    if case == "head size 8":   # transformers runs it; vLLM's CPU attention has no kernel
        model = str(tmp_path / "heads8")
        base = LlamaConfig.from_pretrained(text_model)
        cfg = LlamaConfig(**{**base.to_dict(), "num_attention_heads": 16,
                             "num_key_value_heads": 16, "head_dim": 8})
        LlamaForCausalLM(cfg).save_pretrained(model)
        for f in os.listdir(text_model):
            if f.startswith(("tokenizer", "special_tokens")):
                shutil.copy(os.path.join(text_model, f), model)
        want = ("no kernel for head size 8", "engine=hf")
    elif case == "unmerged lora":
        extra, want = ["--lora-rank", "4", "--no-lora-merge"], ("--no-lora-merge", "engine=hf")
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = "abc"
        want = ("VLLM_CPU_KVCACHE_SPACE='abc'", "whole number of GiB")
    p = subprocess.run([sys.executable, "-m", "parity", "train", "--engine", "vllm", "--model",
                        model, "--steps", "1", *extra, "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert_user_error(p, *want)
    assert not (tmp_path / "run").exists()


@pytest.mark.budget(45)
@pytest.mark.e2e
def test_a_vllm_run_prints_parity_and_not_vllms_own_notes(vllm_ready, text_model, tmp_path):
    """vLLM's logger, its deprecation warnings and its load bar are quiet; what is left on
    stderr is parity's header, parity's own lines (`parity: starting vLLM ...`) and at most a
    line torch's C++ side logs at vLLM's start."""
    import os
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    p = subprocess.run([sys.executable, "-m", "parity", "train", "--engine", "vllm", "--model",
                        str(text_model), "--steps", "1", "--no-progress", "--out",
                        str(tmp_path / "run")], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    foreign = [x for x in p.stderr.splitlines()
               if not x.startswith(("parity ", "parity: ", "ratio=")) and "utils.cpp" not in x]
    assert foreign == [], p.stderr
    assert any(x.startswith("parity: starting vLLM ") for x in p.stderr.splitlines())
