"""Loading a policy and its tokenizer from a model directory, refused in one line when the
directory is not a decoder-only language model or its config disagrees with its weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from parity.errors import ParityError, one_line
from parity.files import check_safetensors, quiet_libraries
from parity.models.forward import head_gives_logits

# Model types whose transformers "causal LM" class is an encoder run as a decoder: their
# weights were trained bidirectionally, so their log-probs are not a policy's.
ENCODER_ONLY = ("bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta",
                "deberta-v2", "camembert", "ernie", "mpnet", "modernbert")


def _causal_lm_config(model_dir: Path) -> Any:
    """The model's config, refused unless it describes a decoder-only language model."""
    try:
        with quiet_libraries():
            config = AutoConfig.from_pretrained(model_dir)
    except Exception as e:
        raise ParityError(f"cannot load a causal LM from {model_dir}: {one_line(e)}") from None
    names = list(getattr(config, "architectures", None) or [])
    causal = [n for n in names if n.endswith(("ForCausalLM", "LMHeadModel"))]
    if config.model_type in ENCODER_ONLY and not getattr(config, "is_decoder", False) or (
            names and not causal):
        what = f"{config.model_type} ({', '.join(names)})" if names else config.model_type
        raise ParityError(f"{model_dir} is not a causal LM: its config describes {what}, an "
                          f"encoder or another head; parity trains decoder-only language models")
    return config


def _check_weights_fit(model: torch.nn.Module, info: dict, model_dir: Path) -> None:
    """Refuse a config.json that disagrees with the weights beside it: transformers would
    otherwise initialise the missing layers at random, or stop after a long report."""
    tied = ({"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False)
            else set())
    missing = sorted(k for k in info.get("missing_keys", ()) if k not in tied)
    mismatched = sorted(info.get("mismatched_keys", ()))
    unexpected = sorted(info.get("unexpected_keys", ()))
    if mismatched:
        k = mismatched[0]
        detail = (f"{k[0]} is {tuple(k[1])} in the weights but {tuple(k[2])} by config.json"
                  if isinstance(k, tuple) and len(k) == 3 else str(k))
        raise ParityError(f"{model_dir}: config.json does not match the weights ({detail}; "
                          f"{len(mismatched)} tensors differ in shape: a vocabulary or width "
                          f"that does not match?)")
    if missing or unexpected:
        which = (f"{len(missing)} weights config.json asks for are not in the files, e.g. "
                 f"{missing[0]}" if missing else
                 f"{len(unexpected)} weights in the files are not in config.json's model, e.g. "
                 f"{unexpected[0]}")
        raise ParityError(f"{model_dir}: config.json does not match the weights: {which} (a "
                          f"layer count that does not match?)")


def load_policy(model_dir: Path) -> tuple[torch.nn.Module, Any]:
    """fp32 master weights and the tokenizer. A directory that is not a causal LM, or whose
    config.json disagrees with its weights, is a user error."""
    config = _causal_lm_config(model_dir)
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        check_safetensors(f, "weights file")
    try:
        with quiet_libraries():
            model, info = AutoModelForCausalLM.from_pretrained(
                model_dir, config=config, dtype=torch.float32, output_loading_info=True,
                ignore_mismatched_sizes=True)
    except Exception as e:
        raise ParityError(f"cannot load a causal LM from {model_dir}: {one_line(e)}") from None
    _check_weights_fit(model, info, model_dir)
    head_gives_logits(model)   # chunked scoring proves itself here, its one line at load
    try:
        with quiet_libraries():
            tok = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:
        raise ParityError(f"cannot load the tokenizer in {model_dir}: {one_line(e)}") from None
    if tok.eos_token_id is None:
        raise ParityError(f"the tokenizer in {model_dir} has no eos token; completions could "
                          f"never end")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def max_positions(model: torch.nn.Module) -> int | None:
    """The model's context length, where its config states one."""
    cfg = model.config
    return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
