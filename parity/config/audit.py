"""The settings of `parity audit` (`AuditSettings`): Config's fields where the audit shares them,
its own beside them. They live with the config so that building the CLI imports no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from parity.config.certificate import RULES
from parity.config.fields import (
    CpuFp16,
    Dtype,
    Kernels,
    ServerEndpoint,
    ShadowKernels,
    check_fields,
    own,
)
from parity.config.run import FIELDS, check_kernels, engine_needs, shared
from parity.engines import SERVER_MIN_TEMPERATURE, EngineNeeds, refuse_unable
from parity.engines.abilities import refuse_temperature
from parity.errors import ParityError


# The fields an audit shares with a run are Config's, so their defaults, help and checks are
# written once. A help differs where the audit uses the field differently (built-in tasks set no
# max_new_tokens here; kl_exact_rows counts per batch), and `task` defaults to None because it is
# one of three inputs.
@dataclass(kw_only=True)
class AuditSettings:
    """What `parity audit` measures, on which input, and how it samples."""
    model: str | None = shared("model")
    engine: str = shared("engine")
    engine_dtype: Dtype = shared("engine_dtype")
    trainer_dtype: Dtype = shared("trainer_dtype")
    task: str | None = shared(
        "task", default=None,
        help=f"Sample prompts of a task: `neg-length`, `neg-length-chat`, `arith`, or a dataset "
             f"file (JSONL/parquet with a `prompt` column) with `--reward` (default: "
             f"{FIELDS['task'].default}).")
    prompts: str | None = own(None, "Sample these prompts: a .txt file, one per line, or "
                              "JSONL/parquet with a `prompt` column.", metavar="FILE")
    rollouts: str | None = own(None, "Audit completions and engine log-probs another system "
                               "wrote (JSONL/parquet: prompt_token_ids, completion_token_ids, "
                               "engine_logprobs[, advantage|reward]).", metavar="FILE")
    server: str | None = own(None, "Sample the prompts (--task or --prompts) from a running "
                             "OpenAI-compatible server (vLLM) at this address, http://HOST:PORT, "
                             "instead of parity's engine; its answers are kept as "
                             "OUT/rollouts.jsonl and audited as --rollouts audits a file "
                             "(docs/serving.md).", metavar="URL")
    server_model: str | None = own(None, "With --server: the served model to ask, an id of its "
                                   "/v1/models (default: the only one it serves).",
                                   metavar="NAME")
    server_endpoint: ServerEndpoint = own(
        "auto", "With --server: `completions` sends the prompt's token ids to /v1/completions, "
        "`chat` the messages to /v1/chat/completions (the server's chat template); `auto`: chat "
        "for conversations or --chat-template.")
    server_timeout_s: float = own(120.0, "With --server: seconds to wait for each answer (one "
                                  "request asks for --group completions of a prompt) before "
                                  "stopping with an error.", gt=0)
    reward: str | None = shared("reward")
    chat_template: bool = shared("chat_template")
    samples: int = own(256, "Completions to sample.", gt=0)
    group: int = own(8, "Completions per prompt (the GRPO group of the advantages).", gt=0)
    max_new_tokens: int = shared("max_new_tokens", help="Max completion tokens, EOS included.")
    temperature: float = shared("temperature")
    top_p: float = shared("top_p")
    top_k: int = shared("top_k")
    # The recipes' clip range, so that the headline is the share a run's clip would see.
    eps: float = own(FIELDS["eps_low"].default, "Clip range of the headline fractions (a sweep "
                     "over eps is always added).", gt=0, lt=1)
    batch_size: int = own(64, "Completions per trainer forward.", gt=0)
    logprob_chunk: int = shared("logprob_chunk")
    kl_exact_rows: int = shared("kl_exact_rows", help="Completions per batch whose whole engine "
                                "distribution is kept for the exact KL(mu||pi) over the "
                                "vocabulary (0 disables).")
    cpu_fp16: CpuFp16 = shared("cpu_fp16")
    kernels: Kernels = shared("kernels")
    lm_head_fp32: bool = shared("lm_head_fp32")
    shadow_kernels: ShadowKernels = shared("shadow_kernels")
    locate: bool = own(False, "Also say where the gap comes from: the trainer against itself "
                       "(the first batch scored again with right padding, and completions one "
                       "at a time) and every layer's and op's output of the engine against the "
                       "trainer's model (docs/diagnostics.md, Where the gap comes from).")
    certify: str | None = own(None, "Judge the trainer and the engine by the zero-mismatch "
                              "certificate (docs/zero-mismatch.md) under this rule, which sets "
                              "the exit status (0 passes, 1 fails, 2 bad input); implies "
                              "--locate. " + " ".join(f"`{r.name}`: {r.summary}."
                                                      for r in RULES.values()),
                              choices=RULES, metavar="RULE")
    locate_rows: int = own(8, "With --locate: completions of the first batch scored again one "
                           "at a time (micro-batch 1).", gt=0)
    locate_sequences: int = own(4, "With --locate: completions traced layer by layer.", gt=0)
    fp16_check: str | None = own(None, "A `parity fp16-check` result (its fp16_check.json or "
                                 "output directory) for this model: the advice then says whether "
                                 "the fp16 recipe fits (docs/diagnostics.md, What to do).",
                                 metavar="FILE")
    adapter: str | None = own(None, "A LoRA adapter directory (peft's save_pretrained, or a LoRA "
                              "run's checkpoint) to apply to --model.", metavar="DIR")
    lora_merge: bool = shared("lora_merge")
    seed: int = shared("seed")
    device: str = shared("device")
    threads: int = shared("threads")
    progress: bool = shared("progress")

    def engine_needs(self) -> EngineNeeds:
        """What the audit asks of its engine. Not kernels=invariant: that is the trainer's side
        here, and the audit measures any engine against it (a training run needs an engine
        that computes the trainer's bits)."""
        return dataclasses.replace(engine_needs(self), invariant=False)

    def validate(self) -> AuditSettings:
        """Refuse bad settings before any work, one line naming the field, as `parity train`
        does: each field's own checks (Config's for the shared ones), then the input."""
        check_fields(self)
        if self.certify:
            self.locate = True
        if self.server:
            refuse_temperature(self.temperature, SERVER_MIN_TEMPERATURE, "a vLLM server")
        refuse_unable(self.engine, self.engine_needs())
        check_kernels(self)
        if len([x for x in (self.task, self.prompts, self.rollouts) if x]) != 1:
            raise ParityError("audit: give exactly one of --task, --prompts, --rollouts")
        if self.model is None:
            raise ParityError("audit: give --model NAME|DIR")
        if self.server and self.rollouts:
            raise ParityError("audit: --server samples the prompts of --task or --prompts; "
                              "--rollouts audits answers already saved")
        if not self.server and (self.server_model is not None
                                or self.server_endpoint != "auto"):
            raise ParityError("audit: --server-model and --server-endpoint apply with --server")
        if self.task and self.group < 2:
            # A task's advantages are group-relative: 0, or NaN with the std, in a group of one.
            raise ParityError(f"group={self.group}: a task's advantages are relative to the "
                              f"group of completions of one prompt; group must be >= 2")
        return self


