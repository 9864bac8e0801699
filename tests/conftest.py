"""Shared fixtures: a private testbed cache with the test-size models, built once per session;
the check that keeps models out of the fast tier (`pytest -m "not e2e"`); and `--budget`, each
test's time limit scaled to the host (tests/budgets.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from budgets import REFERENCE_S, SCALE_ENV, pinned_scale, scale_of, time_reference

# pytest rewrites each test module's asserts on import and keeps the result as bytecode beside
# it. Where the environment says not to write bytecode (PYTHONDONTWRITEBYTECODE, set on some
# shared hosts), it rewrites all of them on every run (CONTRIBUTING.md, "Test time", gives the
# collection's time with and without). The cache is the checkout's own (__pycache__ is
# git-ignored), so the suite writes it regardless; the test runs it starts read it.
sys.dont_write_bytecode = False

# tests/test_tiers.py and tests/test_budgets.py run pytest on made-up test files to check the
# tier rule and the budgets below.
pytest_plugins = ["pytester"]

# The fixtures below that build or load a model (a testbed build takes minutes on a fresh cache)
# or need vLLM. A test that asks for one, itself or through another fixture, is end to end: it
# must carry the `e2e` mark (pyproject.toml's markers), or it would slow the fast tier.
E2E_FIXTURES = frozenset({"text_model", "arith_model", "gpt2_model", "moe_model", "chat_model",
                          "tiny_lm", "vllm_ready"})


# A test's own call (its fixtures' set-up aside: shared engines and testbed builds are paid
# once, by whichever test comes first) may take this long under --budget, unless it carries
# @pytest.mark.budget(seconds). CONTRIBUTING.md lists the tests above it and what each proves.
# Both are seconds on the machine the budgets were set on; tests/budgets.py scales them to this
# host.
DEFAULT_BUDGET_S = 30.0
# A call fails only past this many times its scaled budget; between 1 and this it is listed at
# the end. On two workers a call shares the 2 cores with whatever the other worker runs, and
# between two idle CI runs on one host a test's time differed by up to 2.36 times
# (scripts/call_spread.py; CONTRIBUTING.md, "Test time"): a tighter line fails a landing on
# which test happened to run beside which, and this one still fails a test that doubled.
TOLERANCE = 2.0
SCALE = pytest.StashKey[tuple]()


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run the long end-to-end runs")
    parser.addoption("--budget", action="store_true",
                     help=f"fail a test (not marked slow) whose call takes longer than "
                          f"{TOLERANCE:g} times its budget ({DEFAULT_BUDGET_S:g} s, or "
                          f"@pytest.mark.budget(seconds)) times how much slower than the "
                          f"budgets' machine this host runs a reference workload ({SCALE_ENV} "
                          f"pins it), and list at the end those over their scaled budget")


def budget_s(item) -> float:
    mark = item.get_closest_marker("budget")
    return float(mark.args[0]) if mark else DEFAULT_BUDGET_S


def pytest_sessionstart(session):
    """Under --budget, how much slower than the budgets' machine this host is: timed now, before
    any test has loaded the host with servers and engines, unless PARITY_BUDGET_SCALE pins it."""
    config = session.config
    if not config.getoption("--budget") or config.option.collectonly:
        return
    try:
        pinned = pinned_scale(os.environ)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    if pinned is not None:
        config.stash[SCALE] = (pinned, f"pinned by {SCALE_ENV}")
    else:
        measured = time_reference()
        config.stash[SCALE] = (scale_of(measured),
                               f"reference workload {measured:.3f} s here, "
                               f"{REFERENCE_S:g} s where the budgets were set")


def budget_scale(config) -> str:
    scale, why = config.stash[SCALE]
    return f"scale {scale:.2f} ({why})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under --budget a passing call over TOLERANCE times its budget times the host's scale is
    reported failed, so a budget is raised on purpose and not by drift; one over its scaled
    budget but within that is listed at the end of the run."""
    report = (yield).get_result()
    if not (call.when == "call" and report.passed and SCALE in item.config.stash
            and "slow" not in item.keywords):
        return
    scale, _ = item.config.stash[SCALE]
    budget = budget_s(item)
    limit = budget * scale
    if report.duration > TOLERANCE * limit:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {report.duration:.1f} s, over {TOLERANCE:g} "
                           f"times its budget of {budget:g} s × "
                           f"{budget_scale(item.config)} = {limit:.1f} s: make it faster, or "
                           f"raise the budget on purpose (@pytest.mark.budget and "
                           f"CONTRIBUTING.md's table)")
    elif report.duration > limit:   # on the report, which xdist carries back from its worker
        report.user_properties.append(("over_budget", f"{report.duration:.1f} s against "
                                                      f"{limit:.1f} s"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if SCALE in config.stash:
        terminalreporter.write_line(f"budgets: {budget_scale(config)}")
        for report in terminalreporter.stats.get("passed", []):
            for key, value in report.user_properties:
                if key == "over_budget":
                    terminalreporter.write_line(f"over budget, within {TOLERANCE:g} times it: "
                                                f"{report.nodeid} {value}")


def unmarked_e2e(items) -> list[str]:
    """The tests that ask for an E2E_FIXTURES fixture but are not marked e2e, each named with
    the fixtures it asks for."""
    return [f"{item.nodeid} (asks for {', '.join(sorted(used))})" for item in items
            if (used := E2E_FIXTURES & set(getattr(item, "fixturenames", ())))
            and item.get_closest_marker("e2e") is None]


def fast_tier(config) -> bool:
    return config.getoption("markexpr", "") == "not e2e"


def pytest_ignore_collect(collection_path, config):
    """The fast tier (`-m "not e2e"`) does not even import a test module marked e2e as a whole
    (`pytestmark = ...e2e...`): none of its tests would run, and importing TRL, vLLM or verl for
    them costs the tier more time than its own tests take."""
    if (fast_tier(config) and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")
            and any(line.startswith("pytestmark") and "e2e" in line
                    for line in collection_path.read_text().splitlines())):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    missing = unmarked_e2e(items)
    if missing:
        raise pytest.UsageError("tests that build or load a model must be marked "
                                "@pytest.mark.e2e (pyproject.toml's markers):\n  "
                                + "\n  ".join(missing))
    import torch
    no_gpu = pytest.mark.skip(reason="needs a CUDA device: torch sees none here")
    slow = pytest.mark.skip(reason="long end-to-end run: pass --runslow")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(slow)


def pytest_configure(config):
    """wandb's own off switch for every run the suite starts, in its processes and theirs:
    `report_to=auto` then leaves wandb out (1.5-2.5 s a run; tests/test_loggers.py asks for it
    by name). A test worker of `pytest -n N` takes its share of the cores for torch's threads: N
    workers at torch's default (every core) would oversubscribe them, and idle OpenMP threads
    spin, so two workers would take twice the CPU time for the same wall time."""
    os.environ.setdefault("WANDB_MODE", "disabled")
    if fast_tier(config) and config.getoption("dist", None) == "loadfile" and not any(
            a.startswith("--dist") for a in config.invocation_params.args):
        # pyproject.toml keeps a file's tests on one worker for its module fixtures (engines,
        # servers); the fast tier has none, and a file's tests on one worker kept the other
        # idle (CONTRIBUTING.md, "Test time").
        config.option.dist = "load"
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if workers > 1:
        import torch
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))
    # The bf16 products every parity command runs here (devices.resolve installs them): on a
    # CPU without bf16 instructions, emulated. Otherwise a test's kernels would depend on
    # whether a run in the same worker had resolved a device before it, and a library-level
    # test there would run torch's native bf16 products, 7-50x slower than fp32's
    # (docs/performance.md).
    from parity import cpu_bf16
    cpu_bf16.install()


@pytest.fixture(autouse=True)
def _torch_threads():
    """A run in this process sets torch's thread count (`threads`, 1 in most test runs) and
    would leave the tests after it on one core: each test starts with the count it found."""
    import torch
    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    """PARITY_CACHE for the whole session, so tests never touch the user's cache. A developer
    can point PARITY_TEST_CACHE at a directory to reuse builds between sessions."""
    if os.environ.get("PARITY_TEST_CACHE"):
        path = Path(os.environ["PARITY_TEST_CACHE"])
    elif os.environ.get("PYTEST_XDIST_WORKER"):
        # The workers of one run (pyproject.toml's `-n`) share one cache, the directory above
        # their own: each model is built once, by the first worker that asks, while the others
        # wait for it (parity.files.one_builder).
        path = tmp_path_factory.getbasetemp().parent / "parity-cache"
        path.mkdir(exist_ok=True)
    else:
        path = tmp_path_factory.mktemp("parity-cache")
    os.environ["PARITY_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def text_model(cache) -> Path:
    from parity import testbed
    return testbed.ensure(testbed.TEST_TEXT, cache, progress=False)


@pytest.fixture(scope="session")
def arith_model(cache) -> Path:
    from parity import testbed
    return testbed.ensure(testbed.TEST_ARITH, cache, progress=False)


@pytest.fixture(scope="session")
def gpt2_model(cache) -> Path:
    """The GPT-2 test-size model (architecture coverage), built once for the session: a build
    inside a test's call would count against its budget."""
    from parity import testbed
    return testbed.ensure("text-gpt2-xs", cache, progress=False)


@pytest.fixture(scope="session")
def moe_model(cache) -> Path:
    """The test-size mixture of experts (Qwen3-MoE), built once for the session."""
    from parity import testbed
    return testbed.ensure("moe-xs", cache, progress=False)


@pytest.fixture(scope="session")
def vllm_ready():
    """vLLM's CPU build importable, or a skip; CI sets PARITY_REQUIRE_VLLM=1, where a missing or
    broken vLLM fails the tests that need it instead (README.md installs it)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import vllm  # noqa: F401
    except (ImportError, RuntimeError) as e:
        if os.environ.get("PARITY_REQUIRE_VLLM") == "1":
            pytest.fail(f"PARITY_REQUIRE_VLLM=1 but vLLM cannot be imported: {e}")
        pytest.skip(f"vLLM is not installed here ({e})")
    _compile_vllms_sampler_ops()


def _compile_vllms_sampler_ops() -> None:
    """vLLM's sampler compiles two ops with torch.compile at their first call in a process,
    10-40 s on one core: paid here, in the session's set-up, rather than by whichever test of
    a worker samples with vLLM first (against its budget). Two shapes each, as a batch of
    another size recompiles them with dynamic shapes."""
    import torch
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than
    from vllm.v1.sample.ops.topk_topp_sampler import compiled_random_sample
    with torch.random.fork_rng():   # the tests' random state stays as it was
        for rows, vocab in ((4, 512), (8, 4096)):
            x = torch.randn(rows, vocab)
            batched_count_greater_than(x, x[:, :1])
            compiled_random_sample(torch.softmax(x, -1))


@pytest.fixture(scope="session")
def chat_model(text_model, tmp_path_factory) -> Path:
    """text-xs with a chat template, so that chat requests can be tokenized again (and a server
    can apply the template itself)."""
    import shutil

    from parity.models.loading import load_policy
    d = tmp_path_factory.mktemp("chat-model")
    for f in text_model.iterdir():
        if f.is_file():
            shutil.copy(f, d / f.name)
    _, tok = load_policy(d)
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                         "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    tok.save_pretrained(d)
    return d


@pytest.fixture
def tiny_lm():
    """A randomly initialised real Llama with a 16-token vocabulary: its next-token distribution
    is spread wide enough for statistical tests of sampling."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()
