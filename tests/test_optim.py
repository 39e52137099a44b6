"""The row-sparse rules of BessOptimizer equal PyTorch's own sparse-gradient optimizers."""

from __future__ import annotations

import copy

import pytest
import torch

from pykeen_bess.tables.optim import BessOptimizer, row_sparse_grad

CASES = [
    # optimizer class, hyper-parameters, PyTorch reference for sparse gradients
    (torch.optim.Adam, dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6), torch.optim.SparseAdam),
    (torch.optim.SparseAdam, dict(lr=0.02), torch.optim.SparseAdam),
    (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1, eps=1e-8), torch.optim.Adagrad),
    (torch.optim.SGD, dict(lr=0.1), torch.optim.SGD),
]


def _steps(seed: int = 0, num_steps: int = 6, rows: int = 12, dim: int = 3):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(num_steps):
        touched = torch.unique(torch.randint(rows, (5,), generator=generator))
        yield (
            touched,
            torch.randn(len(touched), dim, generator=generator, dtype=torch.float64),
            torch.randn(4, generator=generator, dtype=torch.float64),
        )


@pytest.mark.parametrize(("cls", "kwargs", "reference_cls"), CASES)
def test_row_sparse_rules_equal_pytorch(cls, kwargs, reference_cls) -> None:
    table = torch.nn.Parameter(torch.randn(12, 3, dtype=torch.float64))
    dense = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    reference_table = torch.nn.Parameter(table.detach().clone())
    reference_dense = torch.nn.Parameter(dense.detach().clone())
    optimizer = BessOptimizer(cls, dense_params=[dense], table_params=[table], hyperparameters=kwargs)
    reference = reference_cls([reference_table], **kwargs)
    dense_cls = torch.optim.Adam if cls is torch.optim.SparseAdam else cls
    reference_dense_optimizer = dense_cls([reference_dense], **kwargs)
    for touched, values, dense_grad in _steps():
        table.grad = row_sparse_grad(table, touched, values)
        reference_table.grad = torch.sparse_coo_tensor(touched.unsqueeze(0), values, table.shape, check_invariants=True)
        dense.grad = dense_grad.clone()
        reference_dense.grad = dense_grad.clone()
        optimizer.step()
        reference.step()
        reference_dense_optimizer.step()
    torch.testing.assert_close(table, reference_table, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dense, reference_dense, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False])
def test_lazy_adam_with_and_without_the_fused_kernel(monkeypatch, fused: bool) -> None:
    """Both ways of computing lazy Adam (PyTorch's fused kernel, elementwise operations) equal SparseAdam."""
    from pykeen_bess import row_rules

    if fused and not row_rules._has_fused_adam("cpu"):
        pytest.skip("this torch has no fused Adam kernel for the CPU")
    monkeypatch.setitem(row_rules._FUSED_ADAM, "cpu", fused)
    test_row_sparse_rules_equal_pytorch(
        torch.optim.Adam, dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, maximize=True), torch.optim.SparseAdam
    )


def test_untouched_rows_do_not_change() -> None:
    table = torch.nn.Parameter(torch.randn(10, 2))
    before = table.detach().clone()
    optimizer = BessOptimizer(torch.optim.Adam, dense_params=[], table_params=[table], hyperparameters=dict(lr=0.1))
    table.grad = row_sparse_grad(table, torch.tensor([2, 5]), torch.ones(2, 2))
    optimizer.step()
    changed = (table.detach() != before).any(dim=1)
    assert changed.nonzero().view(-1).tolist() == [2, 5]


def test_state_dict_round_trip_continues_identically() -> None:
    def make():
        torch.manual_seed(0)
        table = torch.nn.Parameter(torch.randn(12, 3, dtype=torch.float64))
        dense = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
        optimizer = BessOptimizer(torch.optim.Adam, [dense], [table], dict(lr=0.05))
        return table, dense, optimizer

    table, dense, optimizer = make()
    steps = list(_steps(num_steps=8))
    for touched, values, dense_grad in steps[:4]:
        table.grad, dense.grad = row_sparse_grad(table, touched, values), dense_grad.clone()
        optimizer.step()
    state = copy.deepcopy(optimizer.state_dict())  # the state dict references the live tensors
    saved_table, saved_dense = table.detach().clone(), dense.detach().clone()
    for touched, values, dense_grad in steps[4:]:
        table.grad, dense.grad = row_sparse_grad(table, touched, values), dense_grad.clone()
        optimizer.step()

    table2, dense2, optimizer2 = make()
    with torch.no_grad():
        table2.copy_(saved_table)
        dense2.copy_(saved_dense)
    optimizer2.load_state_dict(state)
    for touched, values, dense_grad in steps[4:]:
        table2.grad, dense2.grad = row_sparse_grad(table2, touched, values), dense_grad.clone()
        optimizer2.step()
    torch.testing.assert_close(table2, table)
    torch.testing.assert_close(dense2, dense)


def test_lr_scheduler_drives_both_parts() -> None:
    table = torch.nn.Parameter(torch.randn(4, 2))
    dense = torch.nn.Parameter(torch.randn(2))
    optimizer = BessOptimizer(torch.optim.SGD, [dense], [table], dict(lr=1.0))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    optimizer.step()
    scheduler.step()
    assert [group["lr"] for group in optimizer.param_groups] == [0.5, 0.5]


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (torch.optim.Adam, dict(weight_decay=0.1), "weight_decay"),
        (torch.optim.Adam, dict(amsgrad=True), "amsgrad"),
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9), "momentum"),
        (torch.optim.RMSprop, dict(), "no row-sparse update rule"),
    ],
)
def test_unsupported_options_raise(cls, kwargs, message) -> None:
    table = torch.nn.Parameter(torch.randn(4, 2))
    with pytest.raises(ValueError, match=message):
        BessOptimizer(cls, [], [table], kwargs)


def test_dense_fallback_accepts_any_optimizer() -> None:
    table = torch.nn.Parameter(torch.randn(4, 2))
    optimizer = BessOptimizer(torch.optim.RMSprop, [], [table], dict(lr=0.1), sparse_updates=False)
    table.grad = torch.ones_like(table)
    optimizer.step()
    assert not optimizer.sparse_groups


def _pbg_row_adagrad(table: torch.Tensor, steps: list, lr: float, lr_decay: float, initial: float, eps: float):
    """PyTorch-BigGraph's RowAdagrad rule, written out per row (the reference)."""
    table = table.clone()
    sums = torch.full((table.shape[0],), initial, dtype=table.dtype)
    for step, (touched, values, _) in enumerate(steps, start=1):
        clr = lr / (1 + (step - 1) * lr_decay)
        for row, grad in zip(touched.tolist(), values):
            sums[row] += (grad * grad).mean()
            table[row] -= clr * grad / (sums[row].sqrt() + eps)
    return table, sums


def test_rowwise_adagrad_is_pytorch_biggraphs_rule_dense_sparse_and_row_sparse() -> None:
    from pykeen_bess.tables.optim import RowwiseAdagrad

    kwargs = dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1, eps=1e-8)
    start = torch.randn(12, 3, dtype=torch.float64)
    steps = list(_steps())
    expected, expected_sums = _pbg_row_adagrad(
        start, steps, **{k.replace("_accumulator_value", ""): v for k, v in kwargs.items()}
    )
    dense_grads = torch.nn.Parameter(start.clone())  # a dense gradient, zero on untouched rows
    sparse_grads = torch.nn.Parameter(start.clone())  # a sparse gradient
    bess_table = torch.nn.Parameter(start.clone())  # BessOptimizer's row-sparse rule
    dense_optimizer = RowwiseAdagrad([dense_grads], **kwargs)
    sparse_optimizer = RowwiseAdagrad([sparse_grads], **kwargs)
    bess = BessOptimizer(RowwiseAdagrad, dense_params=[], table_params=[bess_table], hyperparameters=kwargs)
    for touched, values, _ in steps:
        dense_grads.grad = torch.zeros_like(start).index_add_(0, touched, values)
        sparse_grads.grad = torch.sparse_coo_tensor(touched.unsqueeze(0), values, start.shape)
        bess_table.grad = row_sparse_grad(bess_table, touched, values)
        for optimizer in (dense_optimizer, sparse_optimizer, bess):
            optimizer.step()
    for parameter, optimizer in ((dense_grads, dense_optimizer), (sparse_grads, sparse_optimizer), (bess_table, bess)):
        torch.testing.assert_close(parameter.detach(), expected, rtol=1e-12, atol=1e-12)
        # one float of state per row
        torch.testing.assert_close(optimizer.state[parameter]["sum"], expected_sums, rtol=1e-12, atol=1e-12)
        assert optimizer.state[parameter]["sum"].shape == (12,)


def test_rowwise_adagrad_refuses_eps_zero_without_an_initial_accumulator() -> None:
    """A row whose gradients are all zero so far would divide 0 by 0 (NaN rows, then a non-finite loss)."""
    from pykeen_bess.tables.optim import RowwiseAdagrad

    with pytest.raises(ValueError, match="eps=0 needs initial_accumulator_value > 0"):
        RowwiseAdagrad([torch.nn.Parameter(torch.ones(3, 2))], lr=0.1, eps=0.0)
    parameter = torch.nn.Parameter(torch.ones(3, 2))
    optimizer = RowwiseAdagrad([parameter], lr=0.1, eps=0.0, initial_accumulator_value=0.1)
    parameter.grad = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    optimizer.step()
    assert bool(torch.isfinite(parameter).all()) and torch.equal(parameter[1], torch.ones(2))


def test_rowwise_adagrad_without_rows_is_adagrad_and_complex_is_its_real_view() -> None:
    from pykeen_bess.tables.optim import RowwiseAdagrad

    vector = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    reference = torch.nn.Parameter(vector.detach().clone())
    table = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.complex128))
    real = torch.nn.Parameter(torch.view_as_real(table.detach()).clone().view(4, 6))
    optimizers = [RowwiseAdagrad([vector, table], lr=0.1), torch.optim.Adagrad([reference], lr=0.1)]
    optimizers.append(RowwiseAdagrad([real], lr=0.1))
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        grad = torch.randn(5, generator=generator, dtype=torch.float64)
        vector.grad, reference.grad = grad.clone(), grad.clone()
        complex_grad = torch.randn(4, 3, generator=generator, dtype=torch.complex128)
        table.grad = complex_grad
        real.grad = torch.view_as_real(complex_grad).reshape(4, 6).clone()
        for optimizer in optimizers:
            optimizer.step()
    torch.testing.assert_close(vector, reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.view_as_real(table.detach()).reshape(4, 6), real.detach(), rtol=1e-12, atol=1e-12)


def test_rowwise_adagrad_by_name_and_bad_values() -> None:
    import pykeen_bess  # noqa: F401 - registers the optimizer
    from pykeen.optimizers import optimizer_resolver

    from pykeen_bess.tables.optim import RowwiseAdagrad

    assert optimizer_resolver.lookup("rowwise_adagrad") is RowwiseAdagrad
    with pytest.raises(ValueError, match="lr >= 0"):
        RowwiseAdagrad([torch.nn.Parameter(torch.zeros(2, 2))], lr=-1.0)
    with pytest.raises(ValueError, match="maximize=True or False, not 'no'"):  # "no" maximized
        RowwiseAdagrad([torch.nn.Parameter(torch.zeros(2, 2))], maximize="no")


def test_rowwise_adagrad_takes_a_gradient_sparse_in_every_dimension() -> None:
    """``dense.to_sparse()`` (an entry per value) updates its touched rows as the row-sparse gradient does."""
    from pykeen_bess.tables.optim import RowwiseAdagrad

    start = torch.randn(6, 3, dtype=torch.float64)
    grad = torch.zeros(6, 3, dtype=torch.float64)
    grad[1, 0], grad[4] = 0.5, torch.tensor([1.0, -2.0, 0.25], dtype=torch.float64)
    element, row = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    optimizers = [RowwiseAdagrad([element], lr=0.1), RowwiseAdagrad([row], lr=0.1)]
    for _ in range(2):
        element.grad, row.grad = grad.to_sparse(), grad.to_sparse(1)
        assert element.grad.sparse_dim() == 2
        for optimizer in optimizers:
            optimizer.step()
    torch.testing.assert_close(element.detach(), row.detach(), rtol=0, atol=0)
    torch.testing.assert_close(optimizers[0].state[element]["sum"], optimizers[1].state[row]["sum"], rtol=0, atol=0)
    assert not torch.equal(element.detach()[4], start[4]) and torch.equal(element.detach()[0], start[0])


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.RMSprop, torch.optim.SGD])
def test_the_users_hyperparameters_rebuild_the_optimizer(cls) -> None:
    """Keys of a group the constructor does not take are left out (AdamW's group has Adam's decoupled_weight_decay)."""
    from pykeen_bess.tables.optim import optimizer_hyperparameters

    table = torch.nn.Parameter(torch.randn(4, 2))
    hyperparameters = optimizer_hyperparameters(cls([table], lr=0.05))
    assert hyperparameters["lr"] == 0.05
    rebuilt = BessOptimizer(cls, [], [table], hyperparameters, sparse_updates=False)
    assert rebuilt.param_groups[0]["lr"] == 0.05


_GROUPS = {
    "adam": dict(lr=0.01, betas=(0.8, 0.99), eps=1e-3, maximize=False),
    "adagrad": dict(lr=0.1, lr_decay=0.01, eps=1e-3, initial_accumulator_value=0.1, maximize=True),
    "rowwise_adagrad": dict(lr=0.1, lr_decay=0.01, eps=1e-3, initial_accumulator_value=0.1, maximize=False),
    "sgd": dict(lr=0.1, maximize=False),
}


@pytest.mark.parametrize("name", sorted(_GROUPS))
def test_a_rules_in_place_and_device_forms_agree(name: str) -> None:
    """``update_`` (host step counts, in place) and ``apply`` (device tensors, new tensors) compute one update."""
    from pykeen_bess.tables.row_rules import RULES

    rule = RULES[name]
    group = _GROUPS[name]
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(5, 3, dtype=torch.float64, generator=generator)
    shapes = rule.state_shapes((5, 3), group)
    state = {key: torch.full(shape, fill, dtype=torch.float64) for key, (shape, fill) in shapes.items()}
    in_place = (weight.clone(), {key: value.clone() for key, value in state.items()})
    device = (weight.clone(), {key: value.clone() for key, value in state.items()})
    for step in range(1, 5):
        grad = torch.randn(5, 3, dtype=torch.float64, generator=generator)
        in_place = rule.update_(in_place[0].clone(), grad, {k: v.clone() for k, v in in_place[1].items()}, group, step)
        lr = torch.tensor(group["lr"], dtype=torch.float64)
        device = rule.apply(device[0], grad, device[1], group, torch.tensor(float(step), dtype=torch.float64), lr)
        torch.testing.assert_close(device[0], in_place[0], rtol=1e-12, atol=1e-12)
        for key in state:
            torch.testing.assert_close(device[1][key], in_place[1][key], rtol=1e-12, atol=1e-12)


def test_momentum_a_scheduler_set_is_named() -> None:
    """OneCycleLR (cycle_momentum=True) gave SGD momentum 0.95: the error blamed an option the user never set."""
    from pykeen.datasets import Nations
    from pykeen.models import DistMult

    from pykeen_bess.training import BessTrainingLoop

    factory = Nations().training
    with pytest.raises(ValueError, match=r"momentum=0.95.*OneCycleLR and CyclicLR set it"):
        BessTrainingLoop(
            model=DistMult(triples_factory=factory, embedding_dim=8), triples_factory=factory, optimizer="sgd",
            lr_scheduler="OneCycleLR", lr_scheduler_kwargs=dict(max_lr=0.1, total_steps=10),
        )  # fmt: skip


def test_without_a_scheduler_the_optimizers_current_rate_counts() -> None:
    """An optimizer a scheduler had decayed, given without the scheduler, trained at its initial rate (100x)."""
    from pykeen.datasets import Nations
    from pykeen.models import DistMult

    from pykeen_bess.training import BessTrainingLoop

    factory = Nations().training
    model = DistMult(triples_factory=factory, embedding_dim=8)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    loop = BessTrainingLoop(model=model, triples_factory=factory, optimizer=optimizer, num_shards=2)
    assert loop.optimizer.param_groups[0]["lr"] == pytest.approx(0.001)
