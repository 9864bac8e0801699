"""An objective is one registry entry: a new one, registered from outside the library, is a
choice of the config, listed by `parity recipes` and `--help`, and trains, with nothing changed
in parity's own files. The registry imports without torch, so the command line starts fast."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from parity.config import Config, field_specs, make_config
from parity.errors import ParityError
from parity.objectives import OBJECTIVES, Loss, Objective


def reinforce(cfg, b, share) -> Loss:
    """−A·ℓ_π averaged over tokens: REINFORCE on the sampled tokens, no ratio, no clip."""
    adv = b.adv[:, None] if b.adv.dim() == 1 else b.adv
    tokens = float(b.mask.sum())
    loss = share(-(adv * b.logp_pi * b.mask).sum() / tokens, tokens, "tokens")
    return Loss(loss, float(loss.detach()), torch.zeros_like(b.mask, dtype=torch.bool),
                {"toy/tokens": tokens})


TOY = Objective(name="toy-reinforce", summary="REINFORCE on the sampled tokens",
                loss_text="−A·ℓ_π per token, no ratio", loss=reinforce, clip=None)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(OBJECTIVES, TOY.name, TOY)
    return TOY


def test_a_registered_objective_is_a_choice_and_is_listed(toy, capsys):
    from parity.cli import main
    assert toy.name in field_specs(Config)["objective"].choices
    with pytest.raises(ParityError, match=f"objective={toy.name} has no clip; eps_low"):
        make_config({"objective": toy.name, "eps_low": 0.3})
    assert main(["recipes", "--markdown"]) == 0
    assert f"| `{toy.name}` | −A·ℓ_π per token, no ratio |" in capsys.readouterr().out


def test_an_objective_not_registered_is_refused_with_the_registered_ones():
    with pytest.raises(ParityError, match="objective='toy-reinforce' is not one of: ppo-clip, "
                                          "gspo, pg-is, ppo-value, online-dpo"):
        make_config({"objective": "toy-reinforce"})


@pytest.mark.e2e
def test_a_registered_objective_trains_a_step(toy, tmp_path, text_model):
    from parity.trainer import train
    seen = {}

    def before(model):
        seen["start"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        seen["model"] = model
    out = train(make_config({"objective": toy.name, "model": "text-xs", "steps": 1,
                             "prompts_per_step": 4, "samples_per_prompt": 4,
                             "max_new_tokens": 8, "progress": False, "report_to": "none",
                             "out": str(tmp_path / "run")}), on_model=before)
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 1 and row["toy/tokens"] > 0
    assert row["clip/frac"] == 0.0   # it clips nothing
    moved = [k for k, v in seen["model"].state_dict().items()
             if not torch.equal(v, seen["start"][k])]
    assert moved, "the step changed no weight"


def test_the_registries_import_without_torch():
    code = ("import sys; import parity.cli, parity.config, parity.objectives; "
            "print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.stdout.strip() == "False", p.stderr


class NoCacheEngine:
    """A second formulation of parity's engine: every position recomputed from the whole
    sequence, no KV cache, plain transformers attention, in engine precision. Same uniforms,
    same processed distribution, so in fp32 it samples what the hf engine samples."""

    def __init__(self, master, dtype, eos_ids, pad_id):
        from parity.models.precision import low_precision_copy
        self.model = low_precision_copy(master, dtype)
        self.dtype, self.pad_id, self.version, self.eos_ids = dtype, pad_id, 0, list(eos_ids)

    @property
    def device(self):
        return next(self.model.parameters()).device

    def sync(self, master):
        from parity.models.precision import cast_weights_into
        self.version += 1
        return cast_weights_into(master, self.model)

    def load_state(self, state):
        self.model.load_state_dict(state)

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, s, generator, record_rows=None, shard=None,
                 max_batch=0):
        from parity.engines import sample_rows, uniforms
        from parity.logprobs import Rollout, left_pad, positions, processed_logits
        ids, mask = left_pad(prompts, self.pad_id)
        B, P = ids.shape
        done = torch.zeros(B, dtype=torch.bool)
        tokens, logps, valid = [], [], []
        for _ in range(max_new_tokens):
            u = uniforms(generator, B)
            logits = self.model(input_ids=ids, attention_mask=mask,
                                position_ids=positions(mask)).logits[:, -1].float()
            logp = torch.log_softmax(processed_logits(logits, s), -1)
            tok = torch.where(done, self.pad_id, sample_rows(logp, u))
            tokens.append(tok)
            logps.append(torch.where(done, 0.0, logp.gather(-1, tok[:, None]).squeeze(-1)))
            valid.append((~done).float())
            done = done | torch.isin(tok, torch.tensor(self.eos_ids))
            ids = torch.cat([ids, tok[:, None]], 1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            if done.all():
                break
        return Rollout(ids[:, :P], mask[:, :P], torch.stack(tokens, 1), torch.stack(valid, 1),
                       torch.stack(logps, 1), done)

    def score(self, master, r, s):
        raise NotImplementedError("no engine-scored shadow: score_processed=False")

    # A checkpoint keeps the copy as parity's own engines keep theirs.
    def save_weights(self, directory):
        from parity.models.precision import save_copy
        save_copy(self.model, directory)

    def restore_weights(self, master, directory):
        from parity.models.precision import restore_copy
        restore_copy(master, self.model, directory)

    def weight_bytes(self):
        from parity.models.precision import copy_bytes
        return copy_bytes(self.model)

    def replica(self):
        raise NotImplementedError("no asynchronous engine")

    def close(self):
        pass


@pytest.fixture
def no_cache(monkeypatch):
    from parity.engines import ENGINES, EngineCan, EngineEntry
    entry = EngineEntry(
        name="no-cache", summary="every position recomputed, no KV cache",
        can=EngineCan(score_processed=False, lm_head_fp32=False, lora_unmerged=False),
        build=lambda spec: NoCacheEngine(spec.master, spec.dtype, spec.eos_ids, spec.pad_id))
    monkeypatch.setitem(ENGINES, entry.name, entry)
    return entry


def test_a_registered_engine_is_a_choice_and_its_abilities_are_checked(no_cache):
    assert no_cache.name in field_specs(Config)["engine"].choices
    with pytest.raises(ParityError, match="engine=no-cache runs its LM head in the engine's "
                                          "dtype: --lm-head-fp32 needs engine=hf"):
        make_config({"engine": no_cache.name, "lm_head_fp32": True})
    with pytest.raises(ParityError, match="no-cache is given merged weights"):
        make_config({"engine": no_cache.name, "lora_rank": 4, "lora_merge": False})


@pytest.mark.e2e
def test_a_registered_engine_trains_the_run_the_hf_engine_trains(no_cache, tmp_path,
                                                                  text_model):
    """In fp32 both engines sample the same tokens from the same uniforms: the toy engine's
    run is the hf engine's run, a check of the hf engine's KV-cache decoding besides."""
    from parity.trainer import train
    runs = {}
    for engine in ("hf", no_cache.name):
        out = train(make_config({"engine": engine, "recipe": "fp32", "model": "text-xs",
                                 "steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2,
                                 "max_new_tokens": 6, "progress": False, "report_to": "none",
                                 "out": str(tmp_path / engine)}))
        runs[engine] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    hf, toy = runs["hf"], runs[no_cache.name]
    assert [r["step"] for r in toy] == [1, 2]
    for a, b in zip(hf, toy):
        assert a["completion/len_mean"] == b["completion/len_mean"]
        assert a["reward/mean"] == b["reward/mean"]
        assert abs(a["mismatch/kl_k1"] - b["mismatch/kl_k1"]) < 1e-4


# Where a name may appear as a string literal besides its registry: the config's default, and
# other libraries' own names that happen to be parity's: vLLM's logger, verl's `gspo` loss mode.
NAME_LITERALS_ALLOWED = {("parity/config/run.py", "ppo-clip"), ("parity/config/run.py", "hf"),
                         ("parity/engines/vllm.py", "vllm"),
                         ("parity/integrations/verl.py", "gspo")}


def _literals(names: set[str]) -> dict[str, set[str]]:
    """The library modules (parity/ outside experiments/) holding each name as a string."""
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    found: dict[str, set[str]] = {n: set() for n in names}
    for p in (root / "parity").rglob("*.py"):
        rel = p.relative_to(root).as_posix()
        if rel.startswith("parity/experiments/"):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found[node.value].add(rel)
    return found


def test_each_objective_engine_and_metric_name_is_written_in_one_module():
    """A name is changed in one place: its registry entry (or metric_names.py)."""
    from parity.engines import ENGINES
    homes = {**{n: "parity/objectives/__init__.py" for n in OBJECTIVES},
             **{n: "parity/engines/__init__.py" for n in ENGINES},
             "mismatch/beta_abs_mean": "parity/metric_names.py"}
    found = _literals(set(homes))
    extra = {n: sorted(m for m in mods if m != homes[n] and (m, n) not in NAME_LITERALS_ALLOWED)
             for n, mods in found.items()}
    assert all(homes[n] in found[n] for n in homes), found
    assert not any(extra.values()), extra
