"""One rank of `tests/test_trl.py::test_two_ranks_log_the_figures_of_all_their_tokens`, started
by torchrun: two ParityGRPOTrainer steps, keeping the tokens of every loss call, written with
TRL's log to OUT/rank{R}.pt.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/trl_ranks.py MODEL OUT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_trl import _trainer  # noqa: E402


def main(model_dir: str, out: Path) -> None:
    t = _trainer(model_dir, out, steps=2, eps=0.002, per_device_train_batch_size=8)
    calls = []
    diagnose = t._diagnose

    def keeping(inputs, call, mu):
        calls.append({"mask": inputs["completion_mask"].float(), "adv": inputs["advantages"],
                      "pi": call["pi"].float(), "s": call["s"].float(), "mu": mu.float()})
        return diagnose(inputs, call, mu)

    t._diagnose = keeping
    t.train()
    torch.save({"calls": calls, "log": t.state.log_history},
               out / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
