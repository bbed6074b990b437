"""FlatBf16Grads against DeepSpeed's own per-parameter loop: the same fp32 master gradients, bit for bit, and the
loop itself wherever a ``.grad`` stopped being a view of the flat buffer."""
import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

from ds_terapipe.runtime.execution.bf16_grads import FlatBf16Grads


class _Masters:
    """The parts of a BF16_Optimizer that its update_hp_grads/clear_lp_grads use, with DeepSpeed's own code."""
    update_hp_grads = BF16_Optimizer.update_hp_grads
    _update_hp_grad = BF16_Optimizer._update_hp_grad
    clear_lp_grads = BF16_Optimizer.clear_lp_grads
    clear_hp_grads = BF16_Optimizer.clear_hp_grads
    zero_grad = BF16_Optimizer.zero_grad

    def __init__(self, groups: list[list[torch.nn.Parameter]]) -> None:
        self.bf16_groups = groups
        self.immediate_grad_update = False
        self.autoep_folding_tp_group = None
        self.fp32_groups_gradients_flat, self.fp32_groups_gradients, self.fp32_groups_has_gradients = [], [], []
        for group in groups:
            flat = torch.zeros(sum(p.numel() for p in group) + 3)   # + alignment padding, as DeepSpeed pads
            self.fp32_groups_gradients_flat.append(flat)
            views, offset = [], 0
            for p in group:
                views.append(flat.narrow(0, offset, p.numel()))
                offset += p.numel()
            self.fp32_groups_gradients.append(views)
            self.fp32_groups_has_gradients.append([False] * len(group))


def _model(seed: int) -> tuple[torch.nn.Module, list[list[torch.nn.Parameter]]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 4), torch.nn.LayerNorm(4))
    model = model.to(torch.bfloat16)
    params = list(model.parameters())
    return model, [params[:2], params[2:]]


def _backwards(model: torch.nn.Module, opt, flat: FlatBf16Grads | None, replace_at: int | None = None) -> None:
    """Three backwards as a stage runs them, each between clear_lp_grads and update_hp_grads."""
    torch.manual_seed(1)
    if flat is not None:
        flat.begin_step()
    for k in range(3):
        opt.clear_lp_grads()
        x = torch.randn(7, 6, dtype=torch.bfloat16)
        model(x).float().square().sum().backward()
        if k == replace_at:   # something outside autograd replaces a gradient mid-step
            first = next(model.parameters())
            first.grad = first.grad.clone() * 2
        opt.update_hp_grads(clear_lp_grads=False)


def test_flat_update_equals_deepspeeds_loop_and_falls_back_when_a_grad_is_replaced():
    for replace_at in (None, 1):
        ref_model, ref_groups = _model(0)
        ref = _Masters(ref_groups)
        _backwards(ref_model, ref, None, replace_at)
        model, groups = _model(0)
        opt = _Masters(groups)
        flat = FlatBf16Grads.attach(opt)
        _backwards(model, opt, flat, replace_at)
        for got, want in zip(opt.fp32_groups_gradients_flat, ref.fp32_groups_gradients_flat):
            assert torch.equal(got, want), (replace_at, (got - want).abs().max())
        assert opt.fp32_groups_has_gradients == ref.fp32_groups_has_gradients
        assert all(p._hp_grad is hp for g, hps in zip(groups, opt.fp32_groups_gradients) for p, hp in zip(g, hps))
        if replace_at is None:   # the fast path ran: every .grad is still its view of the flat buffer
            assert all(p.grad is v for g, vs in zip(groups, flat.views) for p, v in zip(g, vs))


def test_views_come_back_after_zero_grad_and_frozen_parameters_get_none():
    model, groups = _model(0)
    opt = _Masters(groups)
    flat = FlatBf16Grads.attach(opt)
    _backwards(model, opt, flat)
    opt.zero_grad(set_to_none=True)   # as DeepSpeed's step ends
    assert all(p.grad is None for g in groups for p in g)
    groups[1][0].requires_grad_(False)
    assert FlatBf16Grads.attach(opt) is flat
    flat.begin_step()
    assert groups[1][0].grad is None and groups[0][0].grad is flat.views[0][0]
    opt.clear_lp_grads()
    model(torch.randn(2, 6, dtype=torch.bfloat16)).float().sum().backward()
    opt.update_hp_grads()
    assert opt.fp32_groups_has_gradients[1][0] is False and opt.fp32_groups_has_gradients[0][0] is True
    assert float(opt.fp32_groups_gradients[1][0].abs().sum()) == 0.0


def test_an_update_that_clears_leaves_every_bf16_grad_zero_as_deepspeeds_loop_does():
    """``update_hp_grads(clear_lp_grads=True)`` (BF16_Optimizer's contract; the engine passes False): the next
    backward without a ``clear_lp_grads`` between adds its own gradient only, as after DeepSpeed's loop."""
    masters = []
    for flat_grads in (False, True):
        model, groups = _model(0)
        opt = _Masters(groups)
        if flat_grads:
            FlatBf16Grads.attach(opt).begin_step()
        torch.manual_seed(1)
        for _ in range(2):
            model(torch.randn(7, 6, dtype=torch.bfloat16)).float().square().sum().backward()
            opt.update_hp_grads(clear_lp_grads=True)
            assert all(float(p.grad.abs().sum()) == 0.0 for g in groups for p in g)
        masters.append(opt.fp32_groups_gradients_flat)
    for got, want in zip(*masters[::-1]):
        assert torch.equal(got, want), (got - want).abs().max()
