"""What `pytest --budget` scales the budgets by: a reference workload timed when the session
starts, against its time on the machine the budgets were set on (CONTRIBUTING.md, "Test time").

A budget is seconds on that machine. On a host that runs the workload k times slower, a test
is over budget only past k times its budget, so a slow or busy host fails no test that did not
get slower itself."""

from __future__ import annotations

import math
import time

# The reference workload's best time on the machine the budgets were set on: 2 cores of an Intel
# Xeon with AMX, the one behind CONTRIBUTING.md's budget table. There its best of 200 repeats
# took 0.059-0.064 s of CPU time, and 0.062 s wall-clock in a quiet moment; a busy host leaves
# CPU time nearly as it was, so `python tests/budgets.py` prints both. Set it again there
# whenever the workload below changes.
REFERENCE_S = 0.062

# Timed repeats after one warm-up (allocator, oneDNN's kernels), the best of them kept: a busy
# moment lengthens a repeat and never shortens one. Past MAX_TIMING_S it stops after
# MIN_REPEATS, so a very slow host pays seconds, not a minute, and one stalled repeat is not
# the figure.
REPEATS = 5
MIN_REPEATS = 3
MAX_TIMING_S = 3.0
SCALE_ENV = "PARITY_BUDGET_SCALE"


def _inputs():
    import torch
    g = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    # The shapes of the test models: 16 x 64 tokens, width 64 and vocabulary 512 (text-xs),
    # width 256 and vocabulary 4,096 (the default text model's and the ladder's).
    return dict(x=randn(1024, 64), w1=randn(64, 256), w2=randn(256, 64), head=randn(64, 512),
                targets=torch.randint(0, 512, (1024,), generator=g), wide=randn(1024, 256),
                mlp=randn(256, 768), wide_head=randn(256, 4096), q=randn(16, 4, 64, 64),
                x16=randn(1024, 64, dtype=torch.bfloat16), w16=randn(64, 256, dtype=torch.bfloat16),
                head16=randn(64, 512, dtype=torch.bfloat16))


def _train_step(t):
    """A text-xs-sized training step through autograd: small products, layer norms, GELUs and a
    cross-entropy, forward and backward, where op dispatch costs as much as the arithmetic."""
    import torch
    import torch.nn.functional as F
    w1, w2, head = (t[k].clone().requires_grad_() for k in ("w1", "w2", "head"))
    for _ in range(2):
        h = t["x"]
        for _ in range(2):
            h = F.layer_norm(h + F.gelu(h @ w1) @ w2, (64,))
        F.cross_entropy(h @ head, t["targets"]).backward()
    with torch.no_grad():
        for _ in range(300):   # a Python loop over tiny ops, as the trainer's bookkeeping is
            w1.add_(1e-6)


def _wide_fp32(t):
    """fp32 at the wider models' width: an MLP product, the head over 4,096 tokens, its
    log-softmax and the log-probs of the drawn tokens; and attention's products."""
    import torch
    lp = torch.log_softmax(t["wide"] @ t["wide_head"], -1)
    lp.gather(-1, t["targets"].unsqueeze(-1) % 4096).sum()
    torch.nn.functional.silu(t["wide"] @ t["mlp"])
    q = t["q"]
    torch.softmax((q @ q.transpose(-1, -2)).tril() / 8, -1) @ q


def _bf16(t):
    """A bf16 engine's forward at text-xs' shapes, its products on the path parity's runs take
    here (time_reference). Native bf16 on a CPU with AVX2 alone costs some twenty times fp32: at
    4% of the workload it then nearly doubles the scale, as it slows the tests that sample in
    bf16 natively, without bf16 setting every budget."""
    import torch
    h = torch.nn.functional.gelu(t["x16"] @ t["w16"]) @ t["w16"].T
    torch.log_softmax((h @ t["head16"]).float(), -1)


def reference_workload(t) -> None:
    _train_step(t)
    _wide_fp32(t)
    _bf16(t)


def best_time(run, repeats: int, at_least: int, max_s: float) -> float:
    """The shortest of `repeats` timed calls of `run` after one untimed one; fewer, but at least
    `at_least`, once they have taken `max_s` together."""
    run()
    best, spent = math.inf, 0.0
    for done in range(1, repeats + 1):
        start = time.perf_counter()
        run()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if done >= at_least and spent > max_s:
            break
    return best


def time_reference() -> float:
    """The reference workload's best time here. On one torch thread, as the suite's runs use
    (`--threads 1`): at two threads on a busy 2-core host every small op waits for a descheduled
    worker, and the figure would measure that rather than the host's speed. bf16 products take
    the kernels a parity run takes here (parity/cpu_bf16.py: fp32 ones where the CPU has no bf16
    instructions, unless PARITY_CPU_BF16 says otherwise), and the process's are restored."""
    import torch

    from parity import cpu_bf16
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with cpu_bf16.kernels(emulate=cpu_bf16.wanted()):
            t = _inputs()
            return best_time(lambda: reference_workload(t), REPEATS, MIN_REPEATS, MAX_TIMING_S)
    finally:
        torch.set_num_threads(threads)


def scale_of(measured_s: float, reference_s: float = REFERENCE_S) -> float:
    """How many times slower than the budgets' machine this host is; never below 1. Budgets hold
    fixed waits a faster CPU does not shorten (gloo's 30 s for a dead peer, servers' start-up),
    and a faster host is not a reason to tighten what a test was written to meet."""
    return max(1.0, measured_s / reference_s)


def pinned_scale(environ) -> float | None:
    """PARITY_BUDGET_SCALE's value, the scale to use instead of timing the workload; None if
    unset."""
    raw = environ.get(SCALE_ENV)
    if raw is None or not raw.strip():
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{SCALE_ENV} must be a positive number, not {raw!r}")
    return value


def _best_wall_and_cpu(repeats: int) -> tuple[float, float]:
    import torch

    from parity import cpu_bf16
    torch.set_num_threads(1)
    with cpu_bf16.kernels(emulate=cpu_bf16.wanted()):
        t = _inputs()
        reference_workload(t)
        wall, cpu = math.inf, math.inf
        for _ in range(repeats):
            w, c = time.perf_counter(), time.process_time()
            reference_workload(t)
            wall, cpu = min(wall, time.perf_counter() - w), min(cpu, time.process_time() - c)
    return wall, cpu


if __name__ == "__main__":
    best = time_reference()
    wall, cpu = _best_wall_and_cpu(200)
    from parity import cpu_bf16
    print(f"reference workload {best:.4f} s as --budget times it, scale {scale_of(best):.2f} "
          f"(REFERENCE_S {REFERENCE_S} s); best of 200: {wall:.4f} s, CPU time {cpu:.4f} s; "
          f"{'emulated' if cpu_bf16.wanted() else 'native'} bf16 products")
