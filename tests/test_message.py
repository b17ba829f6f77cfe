"""Message: the finiteness check agrees with a full isfinite mask; in-place sums equal `+`."""

from __future__ import annotations

import pytest
import torch

from fedpers.protocols.base import Message


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_is_finite_agrees_with_the_full_mask(dtype: torch.dtype, bad: float | None) -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        stats = {"A": torch.randn(7, 5, generator=g).to(dtype), "b": torch.randn(11, generator=g).to(dtype)}
        if bad is not None:
            name = "A" if trial % 2 else "b"
            flat = stats[name].view(-1)
            flat[int(torch.randint(flat.numel(), (1,), generator=g))] = bad
        expected = all(bool(torch.isfinite(v).all()) for v in stats.values())
        assert Message(stats, 1).is_finite() is expected


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf")])
def test_is_finite_of_statistics_of_mixed_dtypes_and_complex_ones_agrees_with_the_full_mask(bad: float | None) -> None:
    """Statistics of one dtype are checked through one stack of their minima and maxima; mixed
    dtypes and complex statistics each on their own: the same answer as a full mask either way."""
    for stats in (
        {"A": torch.randn(4, 4), "b": torch.randn(3, dtype=torch.float64), "n": torch.arange(3)},
        {"A": torch.randn(4, 4, dtype=torch.float64), "z": torch.randn(3, dtype=torch.complex128)},
    ):
        for name in [k for k, v in stats.items() if v.is_floating_point() or v.is_complex()]:
            case = {k: v.clone() for k, v in stats.items()}
            if bad is not None:
                case[name].view(-1)[1] = bad
            expected = all(bool(torch.isfinite(v).all()) for v in case.values())
            assert Message(case, 1).is_finite() is expected


def test_empty_and_integer_statistics_are_finite() -> None:
    assert Message({"e": torch.empty(0), "i": torch.arange(4)}, 0).is_finite()


def test_in_place_sum_equals_plus_and_refuses_other_statistics() -> None:
    a = Message({"A": torch.ones(3), "b": torch.full((2,), 2.0)}, 3, 1)
    b = Message({"A": torch.arange(3.0), "b": torch.ones(2)}, 4, 2)
    expected = a + b
    a.add_(b)
    assert a.count == 7 and a.zeroed == 3
    assert all(torch.equal(a.stats[k], expected.stats[k]) for k in a.stats)
    with pytest.raises(ValueError, match="statistics"):
        a.add_(Message({"A": torch.ones(3)}, 1))


def test_in_place_sum_promotes_like_plus_and_copy_owns_its_tensors() -> None:
    a = Message({"A": torch.ones(2, dtype=torch.float32)}, 1)
    b = Message({"A": torch.ones(2, dtype=torch.float64)}, 1)
    assert a.copy().add_(b).stats["A"].dtype == (a + b).stats["A"].dtype == torch.float64
    c = a.copy()
    c.add_(a)
    assert torch.equal(a.stats["A"], torch.ones(2)) and torch.equal(c.stats["A"], torch.full((2,), 2.0))


SHAPES = [(), (0,), (1,), (3,), (1, 3), (2, 3), (2, 1), (1, 1, 3), (2, 0), (0, 3), (4, 2, 3)]


@pytest.mark.parametrize("target", SHAPES)
def test_broadcast_check_agrees_with_torch(target: tuple[int, ...]) -> None:
    """The in-place sum's shape check decides as ``torch.broadcast_shapes`` would (unbroadcastable: False)."""
    from fedpers.protocols.base import _broadcasts_to

    for shape in SHAPES:
        try:
            expected = torch.Size(target) == torch.broadcast_shapes(torch.Size(target), torch.Size(shape))
        except RuntimeError:
            expected = False
        assert _broadcasts_to(torch.Size(shape), torch.Size(target)) is expected, (shape, target)


def test_summing_messages_imports_no_sympy() -> None:
    """torch's own broadcast check imports sympy (0.2 s of every run's start-up); the sum does not need it."""
    import subprocess
    import sys

    code = (
        "import sys, torch; from fedpers.protocols.base import Message; "
        "m = Message({'A': torch.ones(2, 3), 'b': torch.ones(3)}, 1); m.add_(m.copy()); (m + m).add_(m); "
        "print('sympy' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
