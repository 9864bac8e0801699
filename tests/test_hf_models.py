"""Any local Hugging Face causal LM directory: a GPT-2-style and a Qwen2-style model built here
(not testbed models), a chat template, conversational datasets, several weighted rewards."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from cli_helpers import run_main

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")

REWARDS = '''
def short(prompts, completions, completion_ids, **kw):
    return [-float(len(c)) for c in completion_ids]

def letters(prompts, completions, completion_ids, **kw):
    # conversational prompts: TRL hands completions over as assistant messages
    if isinstance(prompts[0], list):
        assert all(c[0]["role"] == "assistant" for c in completions), completions[0]
        completions = [c[0]["content"] for c in completions]
    return [sum(ch.isalpha() for ch in c) / max(len(c), 1) for c in completions]
'''


def _tokenizer(text_model: Path, chat: bool):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(text_model)
    if chat:
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.chat_template = CHAT_TEMPLATE
    return tok


def _build(kind: str, text_model: Path, out: Path) -> Path:
    """A randomly initialised model of the given architecture, saved with its tokenizer."""
    import transformers as tf
    tok = _tokenizer(text_model, chat=kind == "qwen2")
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
               bos_token_id=None)
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=128, **ids)
    else:
        cfg = tf.Qwen2Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=128, tie_word_embeddings=True, **ids)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    if kind == "qwen2":  # a chat model ends its turn with <|im_end|> as well as EOS
        model.generation_config.eos_token_id = [tok.eos_token_id,
                                                tok.convert_tokens_to_ids("<|im_end|>")]
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _parity(*args, cwd: Path) -> subprocess.CompletedProcess:
    """`parity ARGS` run from `cwd`, through the entry point in this process."""
    here = os.getcwd()
    os.chdir(cwd)
    try:
        return run_main(*args)
    finally:
        os.chdir(here)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("data")
    (d / "rewards.py").write_text(REWARDS)
    from parity.tasks.data import text_prompts
    prompts = text_prompts(16)
    with open(d / "chat.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": p}]}) + "\n")
    with open(d / "plain.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    return d


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["gpt2", "qwen2"])
def test_audit_and_train_on_a_local_model_directory(kind, text_model, data, tmp_path):
    """Must-show 2: `parity audit` and `parity train` on a GPT-2-style and a Qwen2-style
    directory; the Qwen2 one takes a conversational dataset through its chat template."""
    model = _build(kind, text_model, tmp_path / kind)
    dataset = data / ("chat.jsonl" if kind == "qwen2" else "plain.jsonl")
    rewards = f"{data / 'rewards.py'}:short,{data / 'rewards.py'}:letters"
    a = _parity("audit", "--model", str(model), "--task", str(dataset), "--reward", rewards,
                "--samples", "32", "--group", "4", "--max-new-tokens", "8", "--no-progress",
                "--out", str(tmp_path / "audit"), cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-2000:]
    audit = json.loads((tmp_path / "audit" / "audit.json").read_text())
    assert audit["metrics"]["mismatch/beta_abs_mean"] > 0
    t = _parity("train", "--model", str(model), "--task", str(dataset), "--reward", rewards,
                "--reward-weights", "1,0.5", "--steps", "3", "--prompts-per-step", "4",
                "--samples-per-prompt", "4", "--max-new-tokens", "8", "--lr", "1e-3",
                "--no-progress", "--report-to", "none", "--out", str(tmp_path / "run"),
                cwd=tmp_path)
    assert t.returncode == 0, t.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    print(f"\n{kind}: audit |beta| mean {audit['metrics']['mismatch/beta_abs_mean']:.2e}; "
          f"train reward/mean by step {[round(m['reward/mean'], 3) for m in rows]}, "
          f"rewards/short/mean {[m['rewards/short/mean'] for m in rows]}, "
          f"rewards/letters/mean {[m['rewards/letters/mean'] for m in rows]}")
    assert all(m["rewards/letters/mean"] > 0 for m in rows)  # so its weight is exercised
    for m in rows:
        # the logged total is the weighted sum of the functions' own means
        total = m["rewards/short/mean"] + 0.5 * m["rewards/letters/mean"]
        assert m["reward/mean"] == pytest.approx(total, abs=1e-5)  # float32 rewards
        assert m["mismatch/beta_abs_mean"] > 0


@pytest.mark.e2e
def test_chat_template_renders_conversations(text_model, tmp_path):
    from parity.tasks import prompt_token_ids
    model = _build("qwen2", text_model, tmp_path / "qwen2")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    conv = [{"role": "user", "content": "hello"}]
    ids = prompt_token_ids(tok, conv, chat_template=False)
    assert tok.decode(ids) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    # a plain prompt with the flag is the same single user turn
    assert prompt_token_ids(tok, "hello", chat_template=True) == ids
    assert prompt_token_ids(tok, "hello", chat_template=False) == tok("hello")["input_ids"]


@pytest.mark.e2e
def test_engine_stops_at_any_end_of_turn_token(text_model, tmp_path):
    """A chat model's generation config lists <|im_end|> besides EOS; the engine ends a
    completion at either."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from parity.engines import stop_token_ids
    from parity.engines.hf import HFEngine
    from parity.logprobs import Sampling
    d = _build("qwen2", text_model, tmp_path / "qwen2")
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(model, tok) == [tok.eos_token_id, im_end]
    with torch.no_grad():  # make <|im_end|> by far the likeliest token
        model.get_output_embeddings().weight[im_end] *= 0
        model.get_output_embeddings().weight[im_end] += model.model.norm.weight.sign() * 5
    eng = HFEngine(model, "fp32", stop_token_ids(model, tok), tok.pad_token_id)
    r = eng.generate([tok("hello there")["input_ids"]] * 8, 6, Sampling(), torch.Generator())
    ends = [c[-1] for c in r.completions()]
    assert r.finished.all() and set(ends) <= {tok.eos_token_id, im_end} and im_end in ends


@pytest.mark.e2e
def test_chat_template_without_one_is_refused(text_model, data, tmp_path):
    model = _build("gpt2", text_model, tmp_path / "gpt2")
    r = _parity("train", "--model", str(model), "--task", str(data / "chat.jsonl"), "--reward",
                f"{data / 'rewards.py'}:short", "--steps", "1", "--no-progress",
                "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("parity: error:")
    assert "chat template" in r.stderr
    assert not (tmp_path / "run").exists()


def test_dataset_formats_read_the_same_rows(tmp_path):
    """JSONL, parquet, a save_to_disk Dataset and a DatasetDict (its train split) give the same
    rows through `datasets`, conversations included."""
    import datasets

    from parity.tasks import load_rows
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i)} for i in range(5)]
    rows += [{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
              "answer": "x"}]
    ds = datasets.Dataset.from_list(rows)
    with open(tmp_path / "d.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"test": ds.select([0]), "train": ds}).save_to_disk(str(tmp_path / "dd"))
    for src in ("d.jsonl", "d.parquet", "saved", "dd"):
        assert load_rows(str(tmp_path / src)) == rows, src


@pytest.mark.e2e
def test_neg_length_chat_asks_chat_questions(text_model, tmp_path):
    """`neg-length-chat`: short questions, each one user turn through the model's chat
    template (no --chat-template needed), rewarded −length; a model without a template is
    refused in one line."""
    model = _build("qwen2", text_model, tmp_path / "qwen2")
    run = tmp_path / "run"
    r = _parity("train", "--model", str(model), "--task", "neg-length-chat", "--steps", "1",
                "--max-new-tokens", "6", "--prompts-per-step", "2", "--samples-per-prompt", "2",
                "--no-progress", "--dump-rollouts", "--out", str(run), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from parity.tasks import build_task
    from parity.tasks.data import chat_questions
    tok = AutoTokenizer.from_pretrained(model)
    qs = chat_questions(256, seed=0)
    assert len({q[0]["content"] for q in qs}) > 100   # varied questions, not a few repeated
    task = build_task("neg-length-chat", None, model, None, tok, 6, None, 0, 1.0)
    def rendered(q):   # transformers 5 returns a BatchEncoding, 4 a list
        out = tok.apply_chat_template(q, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    assert task.prompt_ids == [rendered(q) for q in qs]
    assert tok.decode(task.prompt_ids[0]).startswith("<|im_start|>user\n")
    t = pq.read_table(run / "rollouts" / "step-1.parquet").to_pandas()
    m = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert m["reward/mean"] == pytest.approx(-t.groupby("sample_id").size().mean())

    plain = _build("gpt2", text_model, tmp_path / "gpt2")
    r = _parity("train", "--model", str(plain), "--task", "neg-length-chat", "--steps", "1",
                "--no-progress", "--out", str(tmp_path / "run2"), cwd=tmp_path)
    assert r.returncode == 2 and "chat template" in r.stderr.strip().splitlines()[-1]
