"""A disk that fills mid-run, on a small file system each test mounts itself (tmpfs with a size):
one line naming the path and the space it needs, every written step and the last whole
checkpoint intact, and `--resume` going on once there is room (docs/errors.md, "Full disk and
memory")."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cli_helpers import TINY_RUN, assert_user_error, cli
from parity.runs import checkpoints

pytestmark = pytest.mark.e2e

RUN = TINY_RUN


@pytest.fixture
def small_disk(tmp_path):
    """Mount a tmpfs of the size asked for; skipped where this process may not mount."""
    mounted = []

    def mount(size: str, remount: bool = False) -> Path:
        where = tmp_path / "disk"
        where.mkdir(exist_ok=True)
        opts = f"remount,size={size}" if remount else f"size={size}"
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                           capture_output=True, text=True)
        if p.returncode != 0:
            pytest.skip(f"cannot mount a small file system here: {p.stderr.strip()}")
        if not remount:
            mounted.append(where)
        return where
    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def whole_steps(run: Path) -> list[int]:
    """The steps of metrics.jsonl, every line a whole record (json.loads fails on a cut one)."""
    text = (run / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    return [json.loads(x)["step"] for x in text.splitlines()]


def test_a_checkpoint_on_a_full_disk_is_one_line_and_the_last_one_stays(small_disk, text_model):
    run = small_disk("4m") / "run"  # one checkpoint (2.4 MB) fits; a second beside it does not
    p = cli("train", *RUN, "--steps", "6", "--save-every", "2", "--out", str(run))
    line = assert_user_error(p, "no space left on the device", "checkpoint of step 4",
                             str(run / "checkpoints" / "step-4"), "needs about 2.", "is free",
                             "step-2 stays whole", "--resume")
    assert "MB" in line
    assert whole_steps(run) == [1, 2, 3, 4]
    assert checkpoints.steps_on_disk(run) == [2]
    assert checkpoints.verify(run / "checkpoints" / "step-2") is None
    assert not list((run / "checkpoints").glob(".tmp-*"))  # the partial write is gone
    small_disk("32m", remount=True)
    p = cli("train", "--resume", str(run), "--steps", "6", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert whole_steps(run) == [1, 2, 3, 4, 5, 6]


def test_a_metrics_line_on_a_full_disk_is_one_line_and_the_file_stays_whole(small_disk,
                                                                              text_model):
    run = small_disk("16k") / "run"  # config.yaml and task.json, then a few metrics lines
    p = cli("train", *RUN, "--steps", "40", "--save-every", "0", "--out", str(run))
    line = assert_user_error(p, "no space left on the device", str(run / "metrics.jsonl"),
                             "needs about", "holds every step before it")
    assert "KB" in line
    done = whole_steps(run)
    assert done == list(range(1, len(done) + 1)) and 0 < len(done) < 40
    assert f"step {len(done) + 1}" not in (run / "metrics.jsonl").read_text()


def test_weights_for_a_server_on_a_full_disk_are_one_line_and_no_partial_file(small_disk):
    """AsyncGRPO's weight sync (parity/integrations/weight_sync.py) writes through a directory,
    a tmpfs such as /dev/shm where it can: safetensors reports that file system full as its own
    error. Nothing reaches the server: the write fails before any request."""
    import torch

    from parity.errors import ParityError
    from parity.integrations.weight_sync import DirectoryWeightTransfer
    where = small_disk("256k") / "weights"
    wt = DirectoryWeightTransfer("http://127.0.0.1:9", where)
    wt.dtype = "fp32"   # what init_weight_transfer asks the server for
    where.mkdir()
    with pytest.raises(ParityError) as e:
        wt.send_weights([("w", torch.zeros(256, 1024))])   # 1 MB
    msg = str(e.value)
    for words in ("no space left on the device", "weights of sync 1", str(where),
                  "needs about 1.0 MB", "KB is free there", "the partial write was removed"):
        assert words in msg, msg
    assert list(where.iterdir()) == []
