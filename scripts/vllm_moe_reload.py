"""vLLM's CPU build after a weight reload on a mixture of experts (docs/vllm.md): the mean |Δℓ|
between vLLM and the fp32 trainer on one sequence, as vLLM started from the checkpoint, after
reloading that same checkpoint, and after parity's packing of the experts again
(`_prepack_cpu_experts` in parity/engines/vllm.py); and whether vLLM's expert parameters are
then the start's, bit for bit.

    python scripts/vllm_moe_reload.py [--model moe-xs]
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="moe-xs")
    a = p.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    from parity import testbed
    from parity.engines.vllm import _prepack_cpu_experts
    from parity.models.loading import load_policy
    path = testbed.resolve_model(a.model)
    model, tok = load_policy(path)
    seq = tok("the cat sat on the mat and then it was")["input_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([seq])).logits[0, :-1].float(), -1)
    ref = ref.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
    llm = LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=64,
              enable_prefix_caching=False)

    def gap() -> float:
        o = llm.generate([{"prompt_token_ids": seq}], SamplingParams(max_tokens=1,
                         prompt_logprobs=0), use_tqdm=False)[0]
        got = torch.tensor([float(s[t].logprob) for s, t in zip(o.prompt_logprobs[1:], seq[1:])])
        return float((got - ref).abs().mean())

    def experts(worker) -> dict:
        m = getattr(worker, "worker", worker).model_runner.get_model()
        return {k: v.detach().clone() for k, v in m.named_parameters() if "experts" in k}

    start, start_gap = llm.collective_rpc(experts)[0], gap()
    weights = load_file(str(path / "model.safetensors"))
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
    reloaded_gap = gap()
    packed = llm.collective_rpc(_prepack_cpu_experts)[0]
    after = llm.collective_rpc(experts)[0]
    same = all(torch.equal(start[k], after[k]) for k in start)
    print(f"{a.model}, fp32, mean |vLLM - trainer| per token: started {start_gap:.3g}, "
          f"checkpoint reloaded {reloaded_gap:.3g}, packed again ({packed} MoE layers) "
          f"{gap():.3g}; expert weights the start's bit for bit: {same}")


if __name__ == "__main__":
    main()
