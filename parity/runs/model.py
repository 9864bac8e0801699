"""A run's policy, tokenizer and task, as its config names them: the model resolved (a testbed
or built-in name, or a directory), loaded, and the task built for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from parity import testbed
from parity.models.loading import load_policy, max_positions
from parity.tasks import Task, build_task

if TYPE_CHECKING:
    from parity.config import Config


@dataclass
class ModelAndTask:
    model: torch.nn.Module      # the policy's fp32 master weights
    tok: Any                    # its tokenizer, with a pad token
    model_dir: Path
    task: Task                  # its prompts tokenized for this model

    def longest_prompt(self) -> int:
        return max(map(len, self.task.prompt_ids))


def load_model_and_task(cfg: Config) -> ModelAndTask:
    """The run's policy (fp32), tokenizer, model directory and task, as `cfg` names them."""
    model_dir = testbed.resolve_model(cfg.model)
    model, tok = load_policy(model_dir)
    task = build_task(cfg.task, cfg.reward_specs(), model_dir, model, tok, cfg.max_new_tokens,
                      max_positions(model), cfg.seed, cfg.temperature,
                      cfg.reward_weight_list(), cfg.chat_template,
                      solve_rates=testbed.solve_rates)
    return ModelAndTask(model, tok, model_dir, task)
