"""Loss scaling, skipped updates and weight casts."""

import torch

from parity.precision import LossScaler, cast_weights_into


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
