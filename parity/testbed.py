"""Tiny language models trained from scratch on this machine, so nothing is ever downloaded.

Every model is an ordinary Hugging Face directory (fp32 safetensors, config, tokenizer) that
AutoModelForCausalLM / AutoTokenizer load, so the rest of parity cannot tell it from a real
checkpoint. Builds are deterministic for a given spec and machine, and atomic: a model directory
either holds a finished build (marked by testbed.json, written last) or does not exist.
"""

from __future__ import annotations

# Imports inside functions: torch, transformers and tokenizers load when a model is built or
# measured, so that listing the testbed and resolving a name stay cheap (start-up time).
import json
import math
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from parity.errors import ParityError
from parity.files import cache_dir, ensure_writable, exists, one_builder, publish_dir
from parity.tasks.data import arith_correct, arith_problem, text_corpus
from parity.ui import say


@dataclass(frozen=True)
class ModelSpec:
    """Recipe for one testbed model; the same spec and seed give the same weights.

    name: key in SPECS and the directory name under cache/models.
    kind: "arith" (SFT on `a+b=` problems, char tokenizer), "text" (LM on stdlib paragraphs) or
        "shape" (a real model's shape with random weights, untrained: for speed benches only).
    arch: transformers architecture, "llama", "qwen2", "qwen3", "qwen3_moe" (a mixture of
        experts: `MOE_EXPERTS` experts, `MOE_TOP_K` per token, in every layer) or "gpt2".
    n_layer, d_model, n_head: depth, width and attention heads.
    vocab_size: byte-level BPE vocab size for text models (a shape model's is padded to it with
        tokens no text encodes to); ignored for arith (fixed char vocab).
    seq_len: training sequence length in tokens (max_position_embeddings is at least 256, 4096
        for qwen3); a shape model's context.
    train_steps, batch_size, lr: optimiser steps, sequences per step, peak AdamW learning rate.
    seed: seeds data order, initialisation and corpus shuffle.
    description: one line for listings.
    """

    name: str
    kind: str
    arch: str
    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    seq_len: int
    train_steps: int
    batch_size: int
    lr: float
    seed: int = 0
    description: str = ""


def _text(name, arch, n_layer, d_model, vocab, steps, batch=16, lr=2e-3, seq=128, n_head=None,
          desc=""):
    n_head = n_head or max(2, d_model // 64)
    return ModelSpec(name, "text", arch, n_layer, d_model, n_head, vocab, seq, steps, batch, lr, 0,
                     desc)


_ALL = [
    ModelSpec("arith-xs", "arith", "llama", 2, 64, 2, 0, 16, 700, 64, 3e-3, 0,
              "test-size arithmetic model (partially trained on 1-3 digit addition)"),
    ModelSpec("arith", "arith", "llama", 4, 128, 4, 0, 16, 800, 64, 2e-3, 0,
              "default model for the arith task (partially trained on 1-3 digit addition)"),
    _text("text-xs", "llama", 2, 64, 512, 200, batch=16, lr=3e-3, seq=64,
          desc="test-size text model"),
    _text("text-gpt2-xs", "gpt2", 2, 64, 512, 200, batch=16, lr=3e-3, seq=64,
          desc="test-size GPT-2 text model (architecture coverage)"),
    # Batch 16 x 128: on CPU a batch of 32 costs far more than twice the time per step (the fp32
    # logits fall out of cache; docs/performance.md), and more, smaller steps learn more in a
    # fixed budget.
    _text("text", "llama", 6, 256, 4096, 320, desc="default model for the neg-length task"),
    # Mixtures of experts on the same text (parity/models/routing.py, docs/moe.md).
    _text("moe-xs", "qwen3_moe", 2, 64, 512, 200, batch=16, lr=3e-3, seq=64,
          desc="test-size mixture of experts (Qwen3-MoE: 8 experts, top-2)"),
    _text("moe", "qwen3_moe", 4, 256, 4096, 320,
          desc="mixture of experts for the neg-length task (Qwen3-MoE: 8 experts, top-2)"),
    # The ladder varies one of depth, width, vocab around ladder-base (4 x 256, vocab 4096); every
    # point sees the same tokens (200 steps), so the points differ only in shape.
    _text("ladder-d2", "qwen2", 2, 256, 4096, 200, desc="ladder: depth 2"),
    _text("ladder-base", "qwen2", 4, 256, 4096, 200,
          desc="ladder base: depth 4, width 256, vocab 4096"),
    _text("ladder-d8", "qwen2", 8, 256, 4096, 200, desc="ladder: depth 8"),
    _text("ladder-w128", "qwen2", 4, 128, 4096, 200, desc="ladder: width 128"),
    _text("ladder-w512", "qwen2", 4, 512, 4096, 200, lr=1e-3, desc="ladder: width 512"),
    _text("ladder-v1024", "qwen2", 4, 256, 1024, 200, desc="ladder: vocab 1024"),
    _text("ladder-v16384", "qwen2", 4, 256, 16384, 200, desc="ladder: vocab 16384"),
    # Speed does not depend on the weights' values: this model costs what Qwen3-0.6B costs (28
    # layers, width 1024, 16 query and 8 key-value heads of 128, MLP 3072, vocab 151,936, tied
    # head), so speed and memory benches run at a real model's size (docs/performance.md).
    ModelSpec("qwen3-0.6b-shape", "shape", "qwen3", 28, 1024, 16, 151_936, 256, 0, 0, 0.0, 0,
              "Qwen3-0.6B's shape with random weights (speed benches only)"),
    # What a real vocabulary costs, priced on a CPU: Qwen3's 151,936 tokens and head size on a
    # narrow 2-layer body, so per-vocabulary work (sampling, log-probs, the exact KL) is a real
    # model's while the layers cost little (bench/vocab_step.py).
    ModelSpec("qwen3-narrow-shape", "shape", "qwen3", 2, 256, 2, 151_936, 512, 0, 0, 0.0, 0,
              "Qwen3's vocabulary on a narrow 2-layer body, random weights (speed benches)"),
    # The same body and weights with 32,768 positions: long enough that memory, not the context,
    # ends the longest completions a side trains at (bench/longest.py).
    ModelSpec("qwen3-narrow-long", "shape", "qwen3", 2, 256, 2, 151_936, 32_768, 0, 0, 0.0, 0,
              "qwen3-narrow-shape with Qwen3's 32,768-token context (memory benches)"),
]
SPECS: dict[str, ModelSpec] = {s.name: s for s in _ALL}

TEST_TEXT = "text-xs"
TEST_ARITH = "arith-xs"
DEFAULT_TEXT = "text"
DEFAULT_ARITH = "arith"
LADDER_AXES: dict[str, list[str]] = {
    "depth": ["ladder-d2", "ladder-base", "ladder-d8"],
    "width": ["ladder-w128", "ladder-base", "ladder-w512"],
    "vocab": ["ladder-v1024", "ladder-base", "ladder-v16384"],
}


_MAX_POS = 256
MOE_EXPERTS, MOE_TOP_K = 8, 2
_EOS_TEXT, _PAD_TEXT = "<|endoftext|>", "<|pad|>"
_ARITH_VOCAB = ["<pad>", "<eos>", "<unk>", *"0123456789", "+", "-", "*", "=", " "]
_DONE = "testbed.json"  # written last: its presence marks a finished build


def _mlp_width(d: int) -> int:
    return 32 * math.ceil(8 * d / 3 / 32)  # the usual SwiGLU 8/3 ratio, rounded to 32


def _n_params(s: ModelSpec) -> int:
    """Parameter count (weights only) of the model a spec builds, without building it."""
    d, v = s.d_model, s.vocab_size or len(_ARITH_VOCAB)
    if s.arch == "gpt2":  # tied head, learned positions, 4d MLP
        return s.n_layer * 12 * d * d + (v + _MAX_POS) * d
    if s.arch == "qwen3_moe":   # attention at head size 128, experts of width d/2, the router
        heads = s.n_head * 128
        attn = d * heads * 2 + d * (heads // 2) * 2
        return s.n_layer * (attn + MOE_EXPERTS * 3 * d * (d // 2) + MOE_EXPERTS * d) + 2 * v * d
    return s.n_layer * (4 * d * d + 3 * d * _mlp_width(d)) + 2 * v * d


# Ordered by parameter count, smallest first.
LADDER: list[str] = sorted({n for names in LADDER_AXES.values() for n in names},
                           key=lambda n: _n_params(SPECS[n]))
LARGEST: str = LADDER[-1]

# ----------------------------------------------------------------------------- data

# ----------------------------------------------------------------------------- tokenizers

def _arith_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(_ARITH_VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters back with nothing in between
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


def _padded_tokenizer(spec: ModelSpec, corpus: list[str]):
    """A text tokenizer whose vocabulary has exactly `spec.vocab_size` entries: BPE trained up to
    what the corpus supports, then filler tokens no text encodes to (a random model samples
    them; they decode to their own names)."""
    import dataclasses

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    trained = _text_tokenizer(dataclasses.replace(spec, vocab_size=min(spec.vocab_size, 16384)),
                              corpus)
    data = json.loads(trained._tokenizer.to_str())
    vocab = data["model"]["vocab"]
    added = {t["content"]: t["id"] for t in data["added_tokens"]}
    taken = set(vocab.values()) | set(added.values())
    free = (i for i in range(spec.vocab_size) if i not in taken)
    for i in free:
        vocab[f"filler{i}"] = i
    tok = Tokenizer.from_str(json.dumps(data))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=_EOS_TEXT, pad_token=_PAD_TEXT,
                                   clean_up_tokenization_spaces=False)


def _text_tokenizer(spec: ModelSpec, corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size,
                                  special_tokens=[_EOS_TEXT, _PAD_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    # A slice of the corpus is plenty for a small vocab, and keeps tiny builds fast.
    budget = min(4_000_000, 300 * spec.vocab_size)
    sample, size = [], 0
    for p in corpus:
        if size > budget:
            break
        sample.append(p)
        size += len(p)
    tok.train_from_iterator(sample, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=_EOS_TEXT, pad_token=_PAD_TEXT,
                                   clean_up_tokenization_spaces=False)


# ----------------------------------------------------------------------------- models

def _model(spec: ModelSpec, vocab: int, eos: int, pad: int):
    import transformers as tf

    ids = dict(vocab_size=vocab, eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    if spec.arch == "gpt2":
        cfg = tf.GPT2Config(n_layer=spec.n_layer, n_embd=spec.d_model, n_head=spec.n_head,
                            n_positions=_MAX_POS, **ids)
    elif spec.arch == "qwen3":
        # Qwen3's proportions (its 0.6B release): head size 128 whatever the width, half as many
        # key-value heads as query heads, MLP 3x the width, a tied head.
        cfg = tf.Qwen3Config(num_hidden_layers=spec.n_layer, hidden_size=spec.d_model,
                             num_attention_heads=spec.n_head,
                             num_key_value_heads=spec.n_head // 2, head_dim=128,
                             intermediate_size=3 * spec.d_model,
                             max_position_embeddings=max(4096, spec.seq_len),
                             tie_word_embeddings=True, **ids)
    elif spec.arch == "qwen3_moe":
        # Qwen3-30B-A3B's proportions: head size 128, half as many key-value heads, experts
        # whose MLP is half the width, top-k weights renormalised; every layer sparse. Trained
        # with the load-balancing loss its release used, so the experts share the tokens and
        # the router sees real near ties (parity/models/routing.py).
        cfg = tf.Qwen3MoeConfig(num_hidden_layers=spec.n_layer, hidden_size=spec.d_model,
                                num_attention_heads=spec.n_head,
                                num_key_value_heads=max(1, spec.n_head // 2), head_dim=128,
                                num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K,
                                moe_intermediate_size=spec.d_model // 2,
                                intermediate_size=3 * spec.d_model, norm_topk_prob=True,
                                decoder_sparse_step=1, mlp_only_layers=[],
                                router_aux_loss_coef=0.01, output_router_logits=True,
                                max_position_embeddings=max(_MAX_POS, spec.seq_len),
                                tie_word_embeddings=False, **ids)
    elif spec.arch in ("llama", "qwen2"):
        cls = tf.LlamaConfig if spec.arch == "llama" else tf.Qwen2Config
        # Untied head: the head's precision behaviour is one of the things parity studies.
        cfg = cls(num_hidden_layers=spec.n_layer, hidden_size=spec.d_model,
                  num_attention_heads=spec.n_head, num_key_value_heads=spec.n_head,
                  intermediate_size=_mlp_width(spec.d_model),
                  max_position_embeddings=max(_MAX_POS, spec.seq_len), tie_word_embeddings=False,
                  **ids)
    else:
        raise ParityError(f"unknown testbed arch {spec.arch!r}; expected llama, qwen2, qwen3, "
                          f"qwen3_moe or gpt2")
    model = tf.AutoModelForCausalLM.from_config(cfg)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.generation_config.bos_token_id = None
    return model.float()


def _arith_batches(spec: ModelSpec, tok):
    import torch

    rng = random.Random(spec.seed)
    vocab, eos, pad = tok.get_vocab(), tok.eos_token_id, tok.pad_token_id
    while True:
        ids = torch.full((spec.batch_size, spec.seq_len), pad)
        labels = torch.full_like(ids, -100)
        for i in range(spec.batch_size):
            prompt, answer = arith_problem(rng)
            seq = [vocab[c] for c in prompt + answer] + [eos]
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(prompt): len(seq)] = ids[i, len(prompt): len(seq)]  # answer + eos only
        yield ids, (ids != pad).long(), labels


def _text_batches(spec: ModelSpec, tok, corpus: list[str]):
    import torch

    # One stream of paragraph<eos>paragraph<eos>..., cut into seq_len blocks: the model sees EOS
    # at the natural end of each paragraph and so learns to stop.
    need = spec.train_steps * spec.batch_size * spec.seq_len
    stream: list[int] = []
    enc = tok._tokenizer  # the raw tokenizers object: batch encoding without Python overhead
    for start in range(0, len(corpus), 2000):
        for e in enc.encode_batch(corpus[start: start + 2000], add_special_tokens=False):
            stream += e.ids + [tok.eos_token_id]
        if len(stream) >= need:
            break
    whole = len(stream) // spec.seq_len * spec.seq_len
    blocks = torch.tensor(stream[:whole]).view(-1, spec.seq_len)
    g = torch.Generator().manual_seed(spec.seed)
    while True:
        for idx in torch.randperm(len(blocks), generator=g).split(spec.batch_size):
            if len(idx) == spec.batch_size:
                b = blocks[idx]
                yield b, torch.ones_like(b), b.clone()


def _train(model, batches, spec: ModelSpec, progress: bool) -> float:
    """AdamW with warmup and cosine decay, bf16 autocast over fp32 master weights."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warm = max(1, spec.train_steps // 10)

    def lr_at(step):
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, spec.train_steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    losses: list[float] = []
    model.train()
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), disable=not progress, transient=False) as bar:
        task = bar.add_task(f"building {spec.name}", total=spec.train_steps)
        for _ in range(spec.train_steps):
            ids, mask, labels = next(batches)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.update(task, advance=1, description=f"building {spec.name} loss {losses[-1]:.3f}")
    model.eval()
    tail = losses[-10:]
    return sum(tail) / len(tail)


# ----------------------------------------------------------------------------- build / cache

def _is_built(path: Path, spec: ModelSpec) -> bool:
    """A finished build of this exact spec (a spec edited since the build counts as stale)."""
    try:
        return ((path / "config.json").is_file()
                and json.loads((path / _DONE).read_text())["spec"] == asdict(spec))
    except (OSError, ValueError, KeyError):
        return False


def _spec(name: str) -> ModelSpec:
    if name not in SPECS:
        raise ParityError(f"unknown testbed model {name!r}; known: {', '.join(SPECS)}")
    return SPECS[name]


def _build_into(tmp: Path, spec: ModelSpec, progress: bool) -> None:
    """Train `spec`'s model and save it, with its tokenizer and testbed.json, into `tmp`."""
    import torch
    import transformers

    from parity import cpu_bf16
    cpu_bf16.install()  # the build trains under bf16 autocast: fp32's speed on any CPU
    t0, c0 = time.time(), time.process_time()
    random.seed(spec.seed)
    torch.manual_seed(spec.seed)
    if spec.kind == "arith":
        tok = _arith_tokenizer()
        batches = _arith_batches(spec, tok)
    elif spec.kind == "text":
        corpus = text_corpus(spec.seed)
        tok = _text_tokenizer(spec, corpus)
        batches = _text_batches(spec, tok, corpus)
    elif spec.kind == "shape":
        tok, batches = _padded_tokenizer(spec, text_corpus(spec.seed)), None
    else:
        raise ParityError(f"unknown testbed kind {spec.kind!r}")
    model = _model(spec, len(tok), tok.eos_token_id, tok.pad_token_id)
    loss = _train(model, batches, spec, progress) if batches is not None else None
    # the load-balancing loss is a training term: a saved model's forward returns no router logits
    model.config.output_router_logits = False
    info = {"spec": asdict(spec), "torch": torch.__version__, "bf16": cpu_bf16.describe(),
            "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "final_train_loss": loss,
            "n_params": sum(p.numel() for p in model.parameters())}
    if spec.kind == "arith":
        rng = random.Random(spec.seed + 1_000_003)  # fresh problems, not the training stream
        probs = [arith_problem(rng) for _ in range(500)]
        for key, temp in (("greedy_accuracy", 0.0), ("sampled_accuracy", 1.0)):
            rates = solve_rates(model, probs, samples=1, temperature=temp, tok=tok)
            info[key] = sum(rates) / len(rates)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # save_pretrained draws a bar of its own otherwise
    try:
        model.save_pretrained(tmp, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tok.save_pretrained(tmp)
    info["build_seconds"] = round(time.time() - t0, 2)
    # Summed over threads; well below threads x build_seconds means other work shared the
    # CPU, so build_seconds overstates what the build costs on an idle machine.
    info["cpu_seconds"] = round(time.process_time() - c0, 2)
    (tmp / _DONE).write_text(json.dumps(info, indent=2) + "\n")


def build(name: str, cache: Path | None = None, force: bool = False, progress: bool = True) -> Path:
    """Train testbed model `name` and save it to cache/models/NAME; returns that directory.

    An already built model is returned as is unless force=True.
    """
    spec = _spec(name)
    final = Path(cache or cache_dir()) / "models" / name
    if _is_built(final, spec) and not force:
        return final
    ensure_writable(final.parent, "testbed cache")  # before minutes of training, not after
    final.parent.mkdir(parents=True, exist_ok=True)
    with one_builder(final, progress):
        if _is_built(final, spec) and not force:  # another process built it while this waited
            return final
        if progress:
            say(f"building testbed model {name} ({spec.description}), once: {final}")
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
        publish_dir(lambda: _build_into(tmp, spec, progress), tmp, final,
                    lambda p: _is_built(p, spec))
    return final


def ensure(name: str, cache: Path | None = None, progress: bool = True) -> Path:
    """The finished model directory for `name` (a testbed model, or a built-in pretrained one
    converted from its package), building it first if needed."""
    from parity.models import pretrained
    if name in pretrained.SOURCES:
        return pretrained.build(name, Path(cache or cache_dir()), progress=progress)
    return build(name, cache, progress=progress)


def known_models() -> list[str]:
    """Every name `--model` accepts besides a directory."""
    from parity.models import pretrained
    return [*SPECS, *pretrained.SOURCES]


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_model(name_or_path: str, cache: Path | None = None) -> Path:
    """A Hugging Face causal LM directory for a path or a testbed model name."""
    path = Path(name_or_path).expanduser()
    if exists(path, "model directory") and path.is_dir():
        missing = [] if (path / "config.json").is_file() else ["config.json"]
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            missing.append("a tokenizer (tokenizer.json or tokenizer_config.json)")
        if missing:
            raise ParityError(f"{path} is not a Hugging Face model directory: "
                              f"missing {' and '.join(missing)}")
        return path
    if name_or_path in known_models():
        return ensure(name_or_path, cache)
    if path.exists():
        raise ParityError(f"{path} is a file, not a model directory")
    raise ParityError(f"no model directory {name_or_path!r} and no built-in model of that name; "
                      f"built-in models: {', '.join(known_models())}")


# ----------------------------------------------------------------------------- solve rates

def solve_rates(model_or_dir, problems: list[tuple[str, str]], samples: int = 40,
                temperature: float = 1.0, tok=None, seed: int = 0, batch: int | None = None,
                prompt_ids: list[list[int]] | None = None,
                on_batch: Callable[[int, int, int], None] | None = None) -> list[float]:
    """Fraction of `samples` completions that solve each problem, sampled with parity's own
    engine in fp32 (temperature 0 = greedy), exactly as the arith task then samples them.

    prompt_ids: the prompts as the task will feed them (a chat template applied); default the
        plain problem text.
    batch: completions sampled together; default as many as keep one step's fp32 logits near
        256 MB (4096 on the testbed's character vocabulary).
    on_batch(done, total, solved): called after each batch with completions sampled so far and
        how many were right; it may raise to stop early.
    """
    # torch and the engine load here, not at import: the testbed's listing and cache helpers
    # import this module and must stay cheap.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from parity.engines.hf import HFEngine
    from parity.logprobs import Sampling

    model = model_or_dir
    if isinstance(model_or_dir, (str, Path)):
        model = AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(model_or_dir)
    if batch is None:
        batch = max(samples, min(4096, 2 ** 26 // model.config.vocab_size))
    engine = HFEngine(model, "fp32", tok.eos_token_id, tok.pad_token_id)
    s = Sampling(temperature) if temperature > 0 else Sampling(1.0, top_k=1)
    g = torch.Generator().manual_seed(seed)
    prompt_ids = prompt_ids or [tok(p)["input_ids"] for p, _ in problems]
    ids = [p for p in prompt_ids for _ in range(samples)]
    right: list[bool] = []
    for i in range(0, len(ids), batch):
        r = engine.generate(ids[i: i + batch], 8, s, g)
        texts = tok.batch_decode(r.completions(), skip_special_tokens=True)
        right += [arith_correct(t, problems[(i + k) // samples][1]) for k, t in enumerate(texts)]
        if on_batch is not None:
            on_batch(len(right), len(ids), sum(right))
    return [sum(right[j * samples:(j + 1) * samples]) / samples for j in range(len(problems))]
