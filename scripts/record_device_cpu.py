"""Record the reference runs of tests/test_devices.py for this machine's testbed build.

    python scripts/record_device_cpu.py [--cache DIR]

torch's bf16 kernels are other code on a CPU with AMX than on one without, so the testbed
models build to other weights, and the runs give other figures, from one kind of CPU to the
next (CONTRIBUTING.md, "Figures depend on the CPU"). The test compares `--device cpu` with the
runs recorded for the build whose weights this machine makes. This records them, with the
default device, into tests/data/device_cpu/<first 12 hex digits of text-xs's sha256>/.
Record on a commit whose runs are known good, never to make a failing test pass.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", help="PARITY_CACHE holding (or to hold) the testbed models")
    args = ap.parse_args()
    if args.cache:
        os.environ["PARITY_CACHE"] = args.cache
    from parity import testbed
    from parity.config import make_config
    from parity.files import cache_dir
    from parity.trainer import train
    from test_devices import CASES, REFERENCE, _settings
    cache = cache_dir()
    digests = {}
    for spec in (testbed.TEST_TEXT, testbed.TEST_ARITH):
        path = testbed.ensure(spec, cache, progress=False) / "model.safetensors"
        digests[path.parent.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    out = REFERENCE / digests["text-xs"][:12]
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        for name in CASES:
            run = train(make_config(_settings(Path(tmp), name)))
            (out / f"{name}.jsonl").write_text((run / "metrics.jsonl").read_text())
            print(f"{name}: {out / (name + '.jsonl')}")
    (out / "models.json").write_text(json.dumps(
        {**digests, "recorded": f"by scripts/record_device_cpu.py at {commit}"}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
