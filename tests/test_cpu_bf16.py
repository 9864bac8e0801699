"""bf16 products emulated with fp32 kernels (parity/cpu_bf16.py): the same values as torch's
native bf16 kernels up to the order of the fp32 sums, checked against a float64 reference, in
the forward and through autograd; other dtypes untouched; the setting and its default."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from parity import cpu_bf16, devices
from parity.errors import ParityError

BF16 = torch.bfloat16


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """bf16 values as integers in their order on the line: neighbours differ by 1 (one ulp)."""
    bits = x.contiguous().view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (_ordered(a) - _ordered(b)).abs()


def _products(seed: int = 0):
    """One case per overridden op, each as a model calls it: F.linear with and without a bias
    (addmm, mm), a batched matmul (bmm), baddbmm; K up to 576, a real model's width."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(BF16)
    x3, w, b = r(3, 17, 576), r(200, 576), r(200)
    q, k, c = r(4, 9, 64), r(4, 64, 33), r(4, 9, 33)
    return {
        "linear+bias": (lambda x, w, b: F.linear(x, w, b), (x3[0], w, b)),
        "linear 3-d": (lambda x, w: F.linear(x, w), (x3, w)),
        "matmul": (lambda q, k: q @ k, (q, k)),
        "baddbmm": (lambda c, q, k: torch.baddbmm(c, q, k, alpha=0.5, beta=2.0), (c, q, k)),
    }


def _reference(name: str, args) -> torch.Tensor:
    """The exact product of the bf16 operands (float64 sums K of them far inside a bf16 half
    ulp), rounded once to bf16: what any fp32-accumulating kernel gives bar a near-tie."""
    fn, _ = _products()[name]
    return fn(*(a.double() for a in args)).to(BF16)


@pytest.mark.parametrize("name", list(_products()))
def test_emulated_products_are_the_native_ones_up_to_the_order_of_the_sums(name):
    fn, args = _products()[name]
    want = _reference(name, args)
    with cpu_bf16.kernels(emulate=False, tile=0):
        native = fn(*args)
    with cpu_bf16.kernels(emulate=True, tile=0):
        emulated = fn(*args)
    assert emulated.dtype == native.dtype == BF16 and emulated.shape == native.shape
    # fp32 sums in another order than float64's move a result over a bf16 rounding boundary
    # only where it lies within ~K·2⁻²⁴ of one: a rare element, by one ulp, never more.
    for got in (native, emulated):
        assert int(ulps(got, want).max()) <= 1
        assert float((got != want).float().mean()) < 5e-3
    assert float((emulated != native).float().mean()) < 5e-3


def test_the_emulation_is_an_fp32_kernel_on_the_bf16_values():
    """Its result is, bit for bit, fp32's product of the same values rounded to bf16: a second
    formulation of the same arithmetic, not an approximation of it."""
    fn, (x, w, b) = _products()["linear+bias"]
    with cpu_bf16.kernels(emulate=True, tile=0):
        emulated = fn(x, w, b)
    with cpu_bf16.kernels(emulate=False, tile=0):
        fp32 = F.linear(x.float(), w.float(), b.float()).to(BF16)
    assert torch.equal(emulated, fp32)


def test_gradients_through_emulated_products_are_the_native_ones():
    """autograd's backward products (mm on the gradients) take the emulation too."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 40, 128, generator=g)
    w = torch.randn(96, 128, generator=g)
    grads = {}
    for emulate in (False, True, None):  # None: the float64 reference
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        with cpu_bf16.kernels(emulate=bool(emulate), tile=0):
            if emulate is None:
                y = F.linear(xs.double(), ws.double())
            else:
                with torch.autocast("cpu", dtype=BF16):
                    y = F.linear(xs, ws)
            (y.float() * torch.linspace(-1, 1, 96)).sum().backward()
        grads[emulate] = (xs.grad, ws.grad)
    for native, emulated, ref in zip(grads[False], grads[True], grads[None]):
        # The bf16 gradient of a product is rounded to bf16 on both paths (the fp32 master
        # receives it widened): within bf16's relative half ulp of the reference, 2⁻⁸ plus the
        # cancellation of ±1 weights over 96 terms, so 2% of the largest gradient.
        scale = float(ref.abs().max())
        for got in (native, emulated):
            assert float((got.double() - ref).abs().max()) < 0.02 * scale
        assert float((emulated != native).float().mean()) < 0.01


def test_other_dtypes_keep_torchs_own_kernels_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    for dt in (torch.float32, torch.float64, torch.int64):
        r = lambda *s, dt=dt: (torch.randn(*s, generator=g) * 9).to(dt)
        a, b, c, a3, b3, c3 = r(33, 70), r(70, 21), r(33, 21), r(3, 33, 70), r(3, 70, 21), \
            r(3, 33, 21)
        results = []
        for emulate in (False, True):
            with cpu_bf16.kernels(emulate=emulate, tile=0):
                results.append((torch.mm(a, b), torch.addmm(c, a, b), torch.bmm(a3, b3),
                                torch.baddbmm(c3, a3, b3), a.T.contiguous().T @ b))
        want, got = results
        assert all(x.dtype == dt and torch.equal(x, y) for x, y in zip(got, want))


def test_the_block_restores_what_the_process_had():
    before = cpu_bf16.active()
    with cpu_bf16.kernels(emulate=not before, tile=0):
        assert cpu_bf16.active() is (not before)
        with cpu_bf16.kernels(emulate=before, tile=0):
            assert cpu_bf16.active() is before
        assert cpu_bf16.active() is (not before)
    assert cpu_bf16.active() is before


@pytest.mark.parametrize("value,has,emulate", [
    ("auto", False, True), ("auto", True, False), ("native", False, False),
    ("emulate", True, True), ("", False, True),
])
def test_the_setting_emulates_by_default_only_where_the_cpu_lacks_bf16(value, has, emulate,
                                                                       monkeypatch):
    monkeypatch.setattr(cpu_bf16, "has_bf16_instructions", lambda: has)
    monkeypatch.setenv(cpu_bf16.ENV, value)
    assert cpu_bf16.wanted() is emulate


def test_a_bad_setting_is_one_line_naming_the_variable(monkeypatch):
    monkeypatch.setenv(cpu_bf16.ENV, "fast")
    with pytest.raises(ParityError, match=r"PARITY_CPU_BF16='fast' must be one of: auto, "
                                          r"native, emulate"):
        devices.resolve("cpu")


def test_the_device_in_words_says_which_path_bf16_takes():
    with cpu_bf16.kernels(emulate=True, tile=0):
        assert "bf16 products emulated with fp32 kernels" in devices.describe(
            torch.device("cpu"))
    with cpu_bf16.kernels(emulate=False, tile=0):
        assert "bf16 products native" in devices.describe(torch.device("cpu"))


@pytest.mark.skipif(cpu_bf16.platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="oneDNN's instruction sets are x86's")
def test_onednn_kept_off_bf16_instructions_counts_as_a_cpu_without_them(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv(cpu_bf16.ENV, "auto")
    assert not cpu_bf16.has_bf16_instructions() and cpu_bf16.wanted()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_same_tokens_scored_emulated_and_native_differ_far_less_than_the_gap(seed):
    """What the run-level test below cannot compare (its runs sample apart): the same tokens
    scored by a model's bf16 copy with torch's kernels and with the emulation. The two differ
    only where a product rounds the other way, so by a small share of their gap to fp32 (the
    bound below, 25%, leaves room for other CPUs' kernels), and see the same gap to fp32, the
    one parity measures."""
    import copy

    import transformers as tf
    torch.manual_seed(seed)
    m = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 512, (8, 48), generator=torch.Generator().manual_seed(seed))

    def logp(model):
        with torch.no_grad():
            logits = model(ids).logits.float()
        return logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    fp32, copy_ = logp(m), copy.deepcopy(m).to(BF16)
    with cpu_bf16.kernels(emulate=False, tile=0):
        native = logp(copy_)
    with cpu_bf16.kernels(emulate=True, tile=0):
        emulated = logp(copy_)
    gap = float((native - fp32).abs().mean())
    assert gap > 1e-4                                   # bf16 is far from fp32 here
    assert float((emulated - native).abs().mean()) < 0.25 * gap
    assert float((emulated - fp32).abs().mean()) == pytest.approx(gap, rel=0.1)


@pytest.mark.e2e
def test_a_run_with_emulated_bf16_gives_the_native_runs_figures(tmp_path, text_model,
                                                                monkeypatch):
    """The same bf16-engine run with torch's bf16 kernels and with the emulation: the
    precision gap of the same size, within what rounding ~10⁻⁴ of
    the products the other way moves it. The shadow reproduces the engine on either path."""
    from parity.config import make_config
    from parity.metric_names import BETA_ABS_MEAN, KERNEL_GAP_ABS_MEAN, KL_K3
    from parity.trainer import train
    rows = {}
    for path in ("native", "emulate"):
        monkeypatch.setenv(cpu_bf16.ENV, path)  # what each run's device resolution installs
        with cpu_bf16.kernels(emulate=path == "emulate", tile=0):
            out = train(make_config({
                "model": "text-xs", "recipe": "bf16-engine", "steps": 3, "prompts_per_step": 4,
                "samples_per_prompt": 4, "max_new_tokens": 12, "threads": 1, "seed": 0,
                "lr": 1e-3, "progress": False, "out": str(tmp_path / path)}))
            assert cpu_bf16.active() is (path == "emulate")
        rows[path] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for native, emulated in zip(rows["native"], rows["emulate"]):
        # The rewards are not compared: a draw near a token's edge of the CDF takes the other
        # token when a logit moves by an ulp, and then the completions part. On an AVX2-only CPU
        # (whose native bf16 kernels sum in another order than on one with AMX) the first
        # step's mean reward was -10.31 native against -11.13 emulated, one completion apart.
        # β over 192 tokens: its mean moves by a few % where a product rounds the other way
        # (measured: 0 to 3.3% on a CPU with AMX), far inside its spread over tokens (~20%).
        assert emulated[BETA_ABS_MEAN] == pytest.approx(native[BETA_ABS_MEAN], rel=0.15)
        assert emulated[KL_K3] == pytest.approx(native[KL_K3], rel=0.3)
        # the shadow's gap to the engine stays fp32 rounding's (1e-7 measured), not bf16's
        assert emulated[KERNEL_GAP_ABS_MEAN] < 1e-5 and native[KERNEL_GAP_ABS_MEAN] < 1e-5


def test_a_trainer_on_the_cpu_installs_the_products_a_command_runs_there(monkeypatch):
    """`install_for`, which TRL's trainers call with accelerate's device: on the CPU, what
    `PARITY_CPU_BF16` asks (here forced each way); on any other device, nothing."""
    for setting, emulated in (("emulate", True), ("native", False)):
        monkeypatch.setenv(cpu_bf16.ENV, setting)
        with cpu_bf16.kernels(emulate=False):
            assert cpu_bf16.install_for(torch.device("cpu")) is emulated
            assert cpu_bf16.active() is emulated
    monkeypatch.setenv(cpu_bf16.ENV, "emulate")
    with cpu_bf16.kernels(emulate=False):
        assert cpu_bf16.install_for(torch.device("meta")) is False and not cpu_bf16.active()
