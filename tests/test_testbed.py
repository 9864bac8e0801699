"""Testbed: tiny from-scratch models as ordinary Hugging Face directories (xs models only)."""

import dataclasses
import json
import random
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from parity import testbed as tb
from parity.errors import ParityError
from parity.files import cache_dir, one_builder
from parity.tasks.data import arith_correct, arith_problem, text_corpus, text_prompts


@pytest.fixture(scope="session")
def arith_dir(arith_model):  # the session's shared build (tests/conftest.py)
    return arith_model


@pytest.fixture(scope="session")
def text_dir(text_model):
    return text_model


def _short(monkeypatch, name, steps=20):
    """Make SPECS[name] a few-step variant, for tests about the build machinery, not quality."""
    monkeypatch.setitem(tb.SPECS, name, dataclasses.replace(tb.SPECS[name], train_steps=steps))


def _weights(path):
    return load_file(str(path / "model.safetensors"))


@pytest.mark.e2e
@pytest.mark.parametrize("which", ["arith", "text"])
def test_dir_loads_with_auto_classes(which, arith_dir, text_dir):
    path = arith_dir if which == "arith" else text_dir
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = model.config
    assert tok.pad_token and tok.eos_token and tok.pad_token_id != tok.eos_token_id
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert cfg.max_position_embeddings >= 256
    assert cfg.model_type == "llama" and not cfg.tie_word_embeddings
    assert next(model.parameters()).dtype == torch.float32
    # no BOS
    assert tok("12+3=")["input_ids"] == tok("12+3=", add_special_tokens=False)["input_ids"]
    info = json.loads((path / "testbed.json").read_text())
    assert info["spec"]["name"] == path.name and info["build_seconds"] > 0
    assert "final_train_loss" in info


@pytest.mark.e2e
def test_arith_tokenizer_is_per_character_and_round_trips(arith_dir):
    tok = AutoTokenizer.from_pretrained(arith_dir)
    for s in ["37+58=95", "1 + 2 = 3", "9*9-1=80"]:
        ids = tok(s)["input_ids"]
        assert len(ids) == len(s)
        assert tok.decode(ids) == s
    assert tok.decode(tok("95")["input_ids"] + [tok.eos_token_id], skip_special_tokens=True) == "95"


@pytest.mark.e2e
def test_text_tokenizer_round_trips(text_dir):
    tok = AutoTokenizer.from_pretrained(text_dir)
    for s in ["def f(x):\n    return x  # ünïcode ✓\n", "    class A(B):", "  a  b\t\tc\n\n"]:
        assert tok.decode(tok(s)["input_ids"]) == s
    assert len(tok) == tb.SPECS[tb.TEST_TEXT].vocab_size


@pytest.mark.e2e
def test_arith_model_is_partially_trained(arith_dir):
    info = json.loads((arith_dir / "testbed.json").read_text())
    assert 0 < info["greedy_accuracy"] < 1 and 0 < info["sampled_accuracy"] < 1
    torch.manual_seed(0)
    rng = random.Random(7)
    rates = tb.solve_rates(arith_dir, [arith_problem(rng) for _ in range(60)], samples=40)
    assert any(0.2 <= r <= 0.8 for r in rates)  # the arith task needs problems in this band


@pytest.mark.e2e
def test_text_model_ends_samples_with_eos(text_dir):
    tok = AutoTokenizer.from_pretrained(text_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(text_dir)
    enc = tok(text_prompts(64), return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=24)
    ended = sum(tok.eos_token_id in row for row in out[:, enc["input_ids"].shape[1]:].tolist())
    assert 3 <= ended < 64


@pytest.mark.e2e
def test_gpt2_arch_builds(gpt2_model):
    path = gpt2_model  # built by the session's fixture, as a user's first run builds it
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "gpt2" and model.config.n_positions >= 256
    assert AutoTokenizer.from_pretrained(path).pad_token_id != model.config.eos_token_id


@pytest.mark.e2e
@pytest.mark.parametrize("name", [tb.TEST_ARITH, tb.TEST_TEXT])
def test_same_seed_gives_identical_weights(name, tmp_path, monkeypatch):
    _short(monkeypatch, name)
    a, b = (tb.build(name, tmp_path / d, progress=False) for d in ("a", "b"))
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    monkeypatch.setitem(tb.SPECS, name, dataclasses.replace(tb.SPECS[name], seed=1))
    wc = _weights(tb.build(name, tmp_path / "c", progress=False))
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)


@pytest.mark.e2e
def test_interrupted_build_leaves_nothing_ensure_accepts(tmp_path, monkeypatch):
    _short(monkeypatch, tb.TEST_ARITH)
    real_train = tb._train

    def crash(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(tb, "_train", crash)
    with pytest.raises(KeyboardInterrupt):
        tb.build(tb.TEST_ARITH, tmp_path, progress=False)
    assert list((tmp_path / "models").iterdir()) == []  # no model dir and no temporary leftovers

    # A half-written directory (no testbed.json) is rebuilt, not accepted.
    half = tmp_path / "models" / tb.TEST_ARITH
    half.mkdir()
    (half / "config.json").write_text("{}")
    monkeypatch.setattr(tb, "_train", real_train)
    path = tb.ensure(tb.TEST_ARITH, tmp_path, progress=False)
    assert path == half
    assert (path / "testbed.json").is_file() and (path / "model.safetensors").is_file()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [tb.TEST_ARITH]


@pytest.mark.e2e
def test_ensure_and_resolve_reuse_a_built_model(cache, arith_dir):
    stamp = (arith_dir / "model.safetensors").stat().st_mtime_ns
    assert tb.ensure(tb.TEST_ARITH, cache) == arith_dir
    assert tb.resolve_model(tb.TEST_ARITH, cache) == arith_dir
    assert tb.resolve_model(str(arith_dir)) == arith_dir
    assert (arith_dir / "model.safetensors").stat().st_mtime_ns == stamp


_HOLD = """
import sys, time
from pathlib import Path
from parity.files import one_builder
final = Path(sys.argv[1])
with one_builder(final):
    log = final.parent / "log"
    before = log.read_text() if log.exists() else ""
    log.write_text(before + sys.argv[2] + " in\\n")
    time.sleep(0.3)
    log.write_text(log.read_text() + sys.argv[2] + " out\\n")
"""


def test_one_builder_lets_one_process_build_at_a_time_and_leaves_no_file(tmp_path):
    """Three processes that want the same model directory (the test workers, two runs started
    together) build it one after another, each seeing the others' work finished; the lock file
    is gone afterwards, also after a waiter found it removed under it."""
    final = tmp_path / "m"
    procs = [subprocess.Popen([sys.executable, "-c", _HOLD, str(final), str(i)])
             for i in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    lines = (tmp_path / "log").read_text().split("\n")[:-1]
    assert len(lines) == 6
    for i in range(0, 6, 2):   # each "in" followed by its own "out": no overlap
        who = lines[i].split()[0]
        assert lines[i:i + 2] == [f"{who} in", f"{who} out"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log"]
    with one_builder(final):   # and it can be taken again in this process
        assert (tmp_path / ".m.lock").exists()
    assert not (tmp_path / ".m.lock").exists()


def test_resolve_model_errors_name_the_problem(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ParityError, match=re.escape(str(missing))):
        tb.resolve_model(str(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ParityError, match="config.json") as e:
        tb.resolve_model(str(empty))
    assert str(empty) in str(e.value) and "tokenizer" in str(e.value)
    (empty / "config.json").write_text("{}")
    with pytest.raises(ParityError, match="tokenizer"):
        tb.resolve_model(str(empty))
    with pytest.raises(ParityError, match="no-such-model.*arith-xs"):
        tb.resolve_model("no-such-model")
    with pytest.raises(ParityError, match="no-such-model"):
        tb.build("no-such-model", tmp_path)


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("PARITY_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "parity"
    monkeypatch.setenv("PARITY_CACHE", str(tmp_path / "pc"))
    assert cache_dir() == tmp_path / "pc"
    monkeypatch.delenv("PARITY_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "parity"


def test_arith_problems_are_well_formed():
    rng = random.Random(0)
    for _ in range(200):
        prompt, answer = arith_problem(rng)
        m = re.fullmatch(r"(\d{1,3})\+(\d{1,3})=", prompt)
        assert m and int(answer) == int(m[1]) + int(m[2])
    assert arith_problem(random.Random(3)) == arith_problem(random.Random(3))


def test_arith_grading_is_exact_match_of_the_stripped_completion():
    assert arith_correct(" 95\n", "95")
    assert not arith_correct("095", "95") and not arith_correct("95 1", "95")


def test_corpus_and_prompts_are_deterministic_and_held_out():
    corpus = text_corpus()
    assert corpus == text_corpus() and corpus != text_corpus(seed=1)
    assert all(20 <= len(p) for p in corpus)
    prompts = text_prompts(50)
    assert prompts == text_prompts(50) and len(prompts) == 50
    assert all(8 <= len(p.strip()) and len(p) <= 40 for p in prompts)
    train_text = "\n".join(corpus)
    assert sum(p in train_text for p in prompts) < len(prompts)  # prompts come from held-out text


def test_spec_tables_are_consistent():
    for name in (tb.TEST_TEXT, tb.TEST_ARITH, tb.DEFAULT_TEXT, tb.DEFAULT_ARITH, tb.LARGEST,
                 *tb.LADDER):
        assert tb.SPECS[name].name == name
    assert tb.LARGEST == tb.LADDER[-1] and len(set(tb.LADDER)) == len(tb.LADDER) >= 3
    assert {tb.SPECS[n].arch for n in tb.LADDER} == {"qwen2"}
    assert tb.SPECS[tb.DEFAULT_ARITH].kind == tb.SPECS[tb.TEST_ARITH].kind == "arith"


@pytest.mark.e2e
def test_ensure_rebuilds_a_model_whose_spec_changed(tmp_path, monkeypatch):
    _short(monkeypatch, tb.TEST_ARITH, steps=5)
    path = tb.ensure(tb.TEST_ARITH, tmp_path, progress=False)
    first = _weights(path)
    assert tb.ensure(tb.TEST_ARITH, tmp_path, progress=False) == path
    _short(monkeypatch, tb.TEST_ARITH, steps=6)
    assert tb.ensure(tb.TEST_ARITH, tmp_path, progress=False) == path
    assert json.loads((path / "testbed.json").read_text())["spec"]["train_steps"] == 6
    assert not all(torch.equal(first[k], v) for k, v in _weights(path).items())


@pytest.mark.e2e
def test_a_shape_model_has_its_real_models_size_and_a_tokenizer_of_its_vocab(tmp_path):
    """`qwen3-0.6b-shape` costs what Qwen3-0.6B costs: its parameter count, a tokenizer of its
    vocabulary's size that round-trips text, and filler tokens a random model may sample that
    still decode. Built here at a small size: the same code, in seconds."""
    spec = dataclasses.replace(tb.SPECS["qwen3-0.6b-shape"], name="shape-xs", n_layer=2,
                               d_model=128, n_head=4, vocab_size=20_000)
    tb._build_into(tmp_path, spec, progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    cfg = model.config
    assert cfg.model_type == "qwen3" and cfg.tie_word_embeddings and cfg.head_dim == 128
    assert cfg.num_key_value_heads == 2 and cfg.intermediate_size == 3 * 128
    assert len(tok) == cfg.vocab_size == 20_000
    s = "def f(x):\n    return x  # ünïcode ✓\n"
    assert tok.decode(tok(s)["input_ids"]) == s
    assert tok.decode([19_999]) == "filler19999"
    # Qwen3-0.6B's own count (its model card: 0.6B, 0.44B without embeddings), tied head once
    real = tb.SPECS["qwen3-0.6b-shape"]
    d, f, kv = real.d_model, 3 * real.d_model, real.n_head // 2 * 128
    per_layer = d * real.n_head * 128 * 2 + d * kv * 2 + 3 * d * f + 2 * d + 2 * 128
    assert real.n_layer * per_layer + real.vocab_size * d + d == 596_049_920
    info = json.loads((tmp_path / "testbed.json").read_text())
    assert info["final_train_loss"] is None
