"""Loss scaling, skipped updates and weight casts."""

import torch

from parity.models.precision import LossScaler, cast_weights_into


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def test_fp16_scaler_skips_inf_gradient_and_lowers_scale():
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    sc = LossScaler("fp16", torch.device("cpu"), init_scale=1024.0, growth_interval=400)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.autocast("cpu", dtype=torch.float16):
        out = m(torch.ones(2, 4))
    loss = out.float().sum() * torch.tensor(float("inf"))
    sc.backward(loss)
    applied, norm = sc.step(opt, list(m.parameters()), max_grad_norm=1.0)
    assert not applied and sc.skipped == 1
    assert sc.scale == 512.0  # GradScaler's backoff factor 0.5
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), "an overflowing update was applied"
    assert all(p.grad is None for p in m.parameters())
    # the next finite update goes through, at the lowered scale
    with torch.autocast("cpu", dtype=torch.float16):
        loss = m(torch.ones(2, 4)).float().sum()
    sc.backward(loss)
    applied, norm = sc.step(opt, list(m.parameters()), max_grad_norm=1.0)
    assert applied and sc.skipped == 1 and sc.scale == 512.0
    assert not torch.equal(m.weight, before["weight"])
    assert torch.isfinite(m.weight).all()


def test_fp16_scale_grows_after_growth_interval():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    sc = LossScaler("fp16", torch.device("cpu"), init_scale=8.0, growth_interval=3)
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(torch.ones(1, 4)).float().sum()
        sc.backward(loss)
        sc.step(opt, list(m.parameters()), 1.0)
    assert sc.scale == 16.0 and sc.skipped == 0


def test_fp32_guard_skips_nan_gradient():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sc = LossScaler("fp32", torch.device("cpu"))
    w = m.weight.clone()
    sc.backward(m(torch.ones(1, 4)).sum() * torch.tensor(float("nan")))
    applied, _ = sc.step(opt, list(m.parameters()), 1.0)
    assert not applied and sc.skipped == 1 and torch.equal(m.weight, w)
    assert sc.scale == 1.0


def test_cast_weights_changed_fraction():
    master = _model()
    engine = _model().to(torch.bfloat16)
    cast_weights_into(master, engine)
    assert cast_weights_into(master, engine) == 0.0  # nothing moved
    with torch.no_grad():
        master.weight[0, 0] += 1.0       # a change bf16 can represent
        master.weight[0, 1] *= 1 + 1e-6  # far below bf16's resolution: the cast does not move
    n = sum(p.numel() for p in master.parameters())
    assert cast_weights_into(master, engine) == 1 / n
    assert engine.weight.dtype == torch.bfloat16
    assert torch.equal(engine.weight, master.weight.to(torch.bfloat16))


def test_fp16_matmul_emulation_is_fp16_numerics():
    """Emulated fp16 products equal the float64 product of the fp16-rounded inputs, rounded to
    fp16 (tensor-core numerics), within one fp16 ulp; and agree with torch's native CPU kernel."""
    import torch.nn.functional as F

    from parity.models.precision import FP16MatmulOnCPU, autocast
    torch.manual_seed(0)
    x, w = torch.randn(64, 96), torch.randn(48, 96)
    x16, w16 = x.half(), w.half()
    ref = (x16.double() @ w16.double().t()).half()
    with FP16MatmulOnCPU():
        out = F.linear(x16, w16)
    assert out.dtype == torch.float16
    ulp = torch.finfo(torch.float16).eps * ref.float().abs().clamp(min=2**-14)
    assert ((out.float() - ref.float()).abs() <= ulp).all()
    native = F.linear(x16, w16)
    assert ((out.float() - native.float()).abs() <= ulp).all()
    # under the trainer's fp16 autocast, fp32 tensors are rounded to fp16 first, as autocast does
    with autocast("fp16", torch.device("cpu"), "emulate"):
        out_ac = x @ w.t()
    assert out_ac.dtype == torch.float16 and torch.equal(out_ac, out)
    # gradients flow, in fp32 master dtype
    wp = torch.nn.Parameter(w.clone())
    with autocast("fp16", torch.device("cpu"), "emulate"):
        F.linear(x, wp).float().sum().backward()
    assert wp.grad.dtype == torch.float32 and torch.isfinite(wp.grad).all()


def test_fp16_matmul_emulation_writes_into_out():
    """`torch.mm(a, b, out=tile)` (TRL's chunked log-prob kernel fills tiles this way) gets
    the fp16 product in `tile` itself; before the fix the emulation wrote into a temporary and
    left `tile` uninitialised."""
    from parity.models.precision import FP16MatmulOnCPU
    torch.manual_seed(1)
    a, b = torch.randn(8, 32).half(), torch.randn(32, 16).half()
    ref = (a.double() @ b.double()).half()
    tile = torch.full((8, 16), float("nan"), dtype=torch.float16)
    with FP16MatmulOnCPU():
        ret = torch.mm(a, b, out=tile)
    assert ret is tile
    ulp = torch.finfo(torch.float16).eps * ref.float().abs().clamp(min=2**-14)
    assert ((tile.float() - ref.float()).abs() <= ulp).all()


def test_fp16_emulation_gives_a_row_the_same_result_in_any_batch():
    """An emulated product's row is bit-identical whether it is computed alone (the engine's
    decode step: B rows per linear, one query row per head in attention) or among many (the
    shadow's and the trainer's full-sequence forward), and equals the exact product of the fp16
    inputs rounded once to fp16. With fp32 accumulation, torch's CPU GEMM summed 1-3 rows in
    another order than many, and ~0.1% of the outputs differed by an fp16 ulp: the fp16 kernel
    gap |α| came out 700x bf16's on SmolLM2-135M."""
    import torch.nn.functional as F

    from parity.models.precision import FP16MatmulOnCPU
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 576, generator=g).half()
    w = torch.randn(1536, 576, generator=g).half()
    q = torch.randn(2, 8, 64, 64, generator=g).half()   # attention: [batch, heads, seq, head_dim]
    k = torch.randn(2, 8, 64, 64, generator=g).half()
    with FP16MatmulOnCPU():
        full = F.linear(x, w)
        rows = [F.linear(x[:m], w) for m in (1, 2, 3)]
        scores = q @ k.transpose(2, 3)
        last = q[:, :, -1:] @ k.transpose(2, 3)
    for m, part in zip((1, 2, 3), rows):
        assert torch.equal(part, full[:m])
    assert torch.equal(last, scores[:, :, -1:])
    # the independent reference: float64 product of the fp16 inputs, rounded once
    assert torch.equal(full, (x.double() @ w.double().t()).half())
    assert torch.equal(scores, (q.double() @ k.double().transpose(2, 3)).half())
