"""The one federated protocol of the billboard model, as data plus two functions.

Round r: the server publishes ``broadcast(state, r)``; each client calls
``client_update(r, broadcast, units)`` over the units it holds and sends a
:class:`Message` (per-unit-clipped statistics summed over its units, and the unit count);
the runtime verifies and sums the messages; ``server_update`` privatises the sum through
the :class:`~fedpers.privacy.Privatizer` and returns the new state. A protocol declares a
:class:`StatSpec` per statistic so any runtime can check messages without knowing the
algorithm.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from fedpers.data.units import Units
from fedpers.devices import pending
from fedpers.privacy import ALL_UNITS, Privatizer
from fedpers.privacy.correlated import CorrelatedNoise

Tensor = torch.Tensor
State = dict[str, Tensor]
"""A protocol's server state: named tensors (public parameters and what the releases produced), what
``server_update`` returns, a checkpoint saves and an evaluator reads."""


@dataclass(frozen=True)
class StatSpec:
    """One summed statistic: its shape, the norm bound of one unit's contribution, and
    whether it must be a symmetric matrix (released through symmetric noise)."""

    name: str
    shape: tuple[int, ...]
    per_unit_bound: float = math.inf
    symmetric: bool = False


SYMMETRY_TOLERANCE = 1e4
"""A symmetric statistic may differ from its transpose by this many machine epsilons × its largest entry (rounding)."""


@dataclass
class Message:
    """What a client sends: statistics summed over its units, and how many units contributed.

    ``zeroed`` counts units of ``count`` whose contribution was non-finite and so entered as
    zero (:func:`client_message`); a diagnostic for the operator, not a private release.
    """

    stats: dict[str, Tensor]
    count: int
    zeroed: int = 0

    def __add__(self, other: Message) -> Message:
        return self.copy().add_(other)

    def is_finite(self) -> bool:
        """No NaN or ±inf in any statistic: read off each tensor's min and max, which carry both
        (14× cheaper than a full isfinite mask on the 60 MB DPALS message); one host read."""
        flag = self.finite_flag()
        return True if flag is None else bool(flag)

    def finite_flag(self) -> Tensor | None:
        """:meth:`is_finite` as a 0-dim bool tensor where the statistics are, read by nobody yet: a
        runtime on a GPU ANDs a round's flags and reads them once (None: no floating statistic)."""
        floats = [v for v in self.stats.values() if v.numel() and (v.is_floating_point() or v.is_complex())]
        if not floats:
            return None
        if len(floats) > 1 and not floats[0].is_complex() and all(v.dtype == floats[0].dtype for v in floats):
            # one stack of every statistic's min and max, one isfinite: a few ops a message, not a few per statistic
            return torch.isfinite(torch.stack([m for v in floats for m in torch.aminmax(v)])).all()
        flags = [_finite_flag(v) for v in floats]
        return flags[0] if len(flags) == 1 else torch.stack(flags).all()

    def copy(self) -> Message:
        """A message owning its tensors (a runtime's running sum must not write into a chunk's)."""
        return Message({k: v.clone() for k, v in self.stats.items()}, self.count, self.zeroed)

    def add_(self, other: Message) -> Message:
        """Sum ``other`` into this message in place (a runtime summing its chunks allocates once);
        a sum that would promote the dtype or broadcast the shape is made out of place, as ``+``."""
        if set(self.stats) != set(other.stats):
            raise ValueError(f"cannot add messages with statistics {sorted(self.stats)} and {sorted(other.stats)}")
        for k, v in self.stats.items():
            o = other.stats[k]
            if torch.result_type(v, o) == v.dtype and _broadcasts_to(o.shape, v.shape):
                v.add_(o)
            else:
                self.stats[k] = v + o
        self.count += other.count
        self.zeroed += other.zeroed
        return self


def _finite_flag(v: Tensor) -> Tensor:
    if v.is_complex():
        return torch.isfinite(v).all()
    return torch.isfinite(torch.stack(torch.aminmax(v))).all()


def _broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether ``shape`` broadcasts to exactly ``target`` (``target == torch.broadcast_shapes(target,
    shape)``), decided in plain Python: torch's own check imports sympy on first use (0.2 s of start-up)."""
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target), strict=False))


@dataclass
class Verdict:
    """Outcome of checking one client message; ``reason`` is empty when it is accepted."""

    accepted: bool
    reason: str = ""
    norms: dict[str, float] = field(default_factory=dict)


def verify_message(
    message: Message,
    specs: tuple[StatSpec, ...],
    max_units: int,
    dtype: torch.dtype | None = None,
    symmetric_by_construction: frozenset[str] = frozenset(),
) -> Verdict:
    """Server-side check of one client message: names, shapes, dtype, finiteness, count, norm bounds.

    A message that fails is dropped whole (never clipped), so a bad client cannot shift the
    noisy sum by more than the declared sensitivity of an honest one. ``symmetric_by_construction``
    names statistics the receiving runtime rebuilt from one triangle (each entry and its mirror
    are the same sent number): only their symmetry check is skipped, since no input can fail it.
    """
    expected = {s.name for s in specs}
    if set(message.stats) != expected:
        return Verdict(False, f"statistics {sorted(message.stats)} != expected {sorted(expected)}")
    count = message.count
    if not isinstance(count, int) or count < 0 or count > max_units:
        return Verdict(False, f"unit count {count!r} outside [0, {max_units}]")
    if not isinstance(message.zeroed, int) or not 0 <= message.zeroed <= count:
        return Verdict(False, f"zeroed unit count {message.zeroed!r} outside [0, {count}]")
    norms: dict[str, float] = {}
    for spec in specs:
        value = message.stats[spec.name]
        if not isinstance(value, torch.Tensor):
            return Verdict(False, f"{spec.name}: not a tensor")
        if tuple(value.shape) != tuple(spec.shape):
            return Verdict(False, f"{spec.name}: shape {tuple(value.shape)} != {tuple(spec.shape)}")
        if dtype is not None and value.dtype != dtype:
            return Verdict(False, f"{spec.name}: dtype {value.dtype} != {dtype}")
        # A NaN or ±inf entry makes the 2-norm non-finite, so a finite norm proves every entry
        # finite; only a non-finite norm needs the entrywise check (finite entries can overflow it).
        norm = float(torch.linalg.vector_norm(value.double()))
        if not math.isfinite(norm) and not bool(torch.isfinite(value).all()):
            return Verdict(False, f"{spec.name}: non-finite values")
        if spec.symmetric and spec.name not in symmetric_by_construction:
            peak = float(value.abs().max()) if value.numel() else 0.0
            asymmetry = float((value - value.transpose(0, 1)).abs().max()) if value.numel() else 0.0
            if asymmetry > SYMMETRY_TOLERANCE * torch.finfo(value.dtype).eps * peak:
                return Verdict(False, f"{spec.name}: not symmetric (max |S − Sᵀ| = {asymmetry:.3g})")
        norms[spec.name] = norm
        limit = count * spec.per_unit_bound * (1 + 1e-6) + 1e-9
        if norm > limit:
            return Verdict(False, f"{spec.name}: norm {norm:.4g} > count × per-unit bound = {limit:.4g}", norms)
    return Verdict(True, "", norms)


def all_take_part(keep: Tensor) -> bool:
    """Whether a client may use its chunk as it is instead of selecting the rows ``keep`` marks as
    taking part in the round. True only under deferred checks (the local runtime on a GPU, whose
    chunks hold just the round's units: :meth:`Protocol.units_needed`): then ``keep.all()`` is
    recorded (:func:`fedpers.devices.pending`) rather than read, and a round where it did not hold is
    made again with the rows selected. Otherwise False, and the caller selects as it always did."""
    checks = pending()
    if checks is None:
        return False
    checks.expect(keep.all())
    return True


def cohort_size(name: str, summed: Message, privatizer: Privatizer, sampling_rate: float) -> dict[str, float]:
    """A Poisson round's cohort size for its diagnostics: ``name`` = |S| exactly where the server drew the
    cohort itself (central DP: the trusted curator's own record, never a release); where the nodes drew it
    (distributed DP) |S| is not released, and only ``expected_`` + ``name`` = q × the units the public plan
    made eligible (``summed.count`` there: a function of the plan) is recorded."""
    if privatizer.knows_cohort:
        return {name: float(summed.count)}
    return {f"expected_{name}": sampling_rate * summed.count}


def zero_message(specs: tuple[StatSpec, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> Message:
    return Message({s.name: torch.zeros(s.shape, dtype=dtype, device=device) for s in specs}, 0)


def client_message(protocol: Protocol, round: int, broadcast: Mapping[str, Tensor], units: Units) -> Message:
    """``protocol.client_update`` under the per-unit rule: a unit whose contribution is
    non-finite (or whose numerics fail) enters the sum as zero and is counted in ``zeroed``.

    No data can make a client fail, so a neighbour can never turn a completed run into an
    aborted one, and a bad unit never takes its node's other units with it. Protocols
    compute their statistics in forms that stay finite and bounded for every finite input;
    this catches what is left (data that is not finite in the working dtype, e.g. 1e39 in
    float32). The halving search costs O(bad units × log units) extra calls and only runs
    when a sum is non-finite. Under deferred checks (:func:`fedpers.devices.pending`) the message is
    returned as made and its finiteness recorded, not read: a round where it fails is made again
    with this rule applied.
    """
    checks = pending()
    try:
        message = protocol.client_update(round, broadcast, units)
        if checks is not None:  # deferred (a GPU round): finite, or the round is made again under this rule
            flag = message.finite_flag()
            if flag is not None:
                checks.expect(flag)
            return message
        if message.is_finite():
            return message
    except torch.linalg.LinAlgError:
        pass
    n = int(units["ids"].shape[0])
    if n <= 1:
        zero = zero_message(protocol.stat_specs(round), protocol.dtype, units["ids"].device)
        count = protocol.units_in_round(round, units)
        return Message(zero.stats, count, count)
    half = n // 2
    first = {k: v[:half] for k, v in units.items()}
    second = {k: v[half:] for k, v in units.items()}
    return client_message(protocol, round, broadcast, first) + client_message(protocol, round, broadcast, second)


@dataclass
class UnitStatistics:
    """Each unit's own contribution to a round's statistics, batched: ``stats[name]`` is (U, *shape), row j
    what ``client_update`` sends for unit ``ids[j]`` alone, over the units of a batch that take part in the
    round (distributed and local DP encode or noise each unit's contribution on its node)."""

    ids: Tensor
    stats: dict[str, Tensor]
    alone: Tensor | None = None
    """Positions in the batch of taking-part units the protocol left out of ``stats`` (their numerics take
    another branch for each alone, e.g. norms not trusted as computed): computed with ``client_update``
    on each alone."""


def unit_contributions(
    protocol: Protocol, round: int, broadcast: Mapping[str, Tensor], units: Units, *, batched: bool = True
) -> tuple[UnitStatistics, int]:
    """Each unit's own contribution and how many were zeroed, under the per-unit rule of
    :func:`client_message` for one unit: a unit whose contribution is not finite, or whose numerics fail,
    contributes zero and is counted.

    ``batched``: one :meth:`Protocol.unit_statistics` call for the whole batch where the protocol provides
    it (its numerics failing for the batch: unit by unit); otherwise, and with ``batched`` False,
    :func:`client_message` on each unit alone (the reference the batched path equals bit for bit:
    tests/test_node_batched.py)."""
    got = None
    if batched:
        try:
            got = protocol.unit_statistics(round, broadcast, units)
        except torch.linalg.LinAlgError:
            got = None
    if got is None:
        return _one_by_one(protocol, round, broadcast, units)
    bad = torch.zeros(got.ids.shape[0], dtype=torch.bool)
    for value in got.stats.values():
        flat = value.flatten(1) if value.dim() > 1 else value.unsqueeze(1)
        if flat.shape[0] and flat.shape[1]:
            bad |= ~torch.isfinite(torch.stack(torch.aminmax(flat, dim=1))).all(0).cpu()
    zeroed = int(bad.sum())
    if zeroed:  # a zeroed unit's row is set to 0, not scaled by 0 (inf·0 is NaN)
        stats = {
            k: torch.where(bad.to(v.device).reshape(-1, *([1] * (v.dim() - 1))), torch.zeros((), dtype=v.dtype), v)
            for k, v in got.stats.items()
        }
        got = UnitStatistics(got.ids, stats, got.alone)
    if got.alone is None or got.alone.numel() == 0:
        return got, zeroed
    alone = got.alone.to(units["ids"].device)
    rest, more = _one_by_one(protocol, round, broadcast, {k: v[alone] for k, v in units.items()})
    ids = torch.cat([got.ids.cpu(), rest.ids.cpu()])
    where = {int(u): i for i, u in enumerate(units["ids"].cpu().tolist())}
    order = torch.tensor([where[int(u)] for u in ids.tolist()], dtype=torch.int64).argsort()  # the batch's order
    stats = {k: torch.cat([v, rest.stats[k].to(v.device, v.dtype)])[order.to(v.device)] for k, v in got.stats.items()}
    return UnitStatistics(ids[order], stats), zeroed + more


def _one_by_one(
    protocol: Protocol, round: int, broadcast: Mapping[str, Tensor], units: Units
) -> tuple[UnitStatistics, int]:
    """:func:`unit_contributions` by :func:`client_message` on each unit alone (one thread: one unit's
    statistics are tiny, and threads only add their start-up, 10× on a busy machine)."""
    specs = protocol.stat_specs(round)
    rows: dict[str, list[Tensor]] = {s.name: [] for s in specs}
    ids: list[int] = []
    zeroed = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(int(units["ids"].shape[0])):
            one: Units = {k: v[i : i + 1] for k, v in units.items()}
            msg = client_message(protocol, round, broadcast, one)
            if msg.count == 0:
                continue
            ids.append(int(units["ids"][i]))
            zeroed += msg.zeroed
            for s in specs:
                rows[s.name].append(msg.stats[s.name])
    finally:
        torch.set_num_threads(threads)
    device = units["ids"].device
    stats = {
        s.name: torch.stack(rows[s.name])
        if rows[s.name]
        else torch.zeros(0, *s.shape, dtype=protocol.dtype, device=device)
        for s in specs
    }
    return UnitStatistics(torch.tensor(ids, dtype=torch.int64), stats), zeroed


@dataclass(frozen=True)
class NodeSide:
    """A protocol's declaration that it can run under distributed or local DP (docs/contributing.md,
    "Trust models"): every release in ``server_update`` is ``privatizer.gaussian_sum`` or
    ``symmetric_gaussian_sum`` of a statistic exactly as summed (``summed.stats[name]``, untransformed),
    each at one noise multiplier z calibrated by the accountant, so each node can add its share of that
    noise to its own sum and the server only adds. The runtime derives the nodes' plan from this alone."""

    noise_multiplier: float
    """z of every sum release (0: no noise)."""
    psd_statistics: tuple[str, ...] = ()
    """Statistics whose every unit's contribution is a PSD matrix (its √2 replace-one bound survives rounding)."""
    sampling_rate: float = 1.0
    """q < 1: each round's units are a Poisson sample (the broadcast's ``sampled``), every release of the round
    made with ``sampling_probability`` q. Under distributed DP each node draws its own units' membership
    (the server's draw is replaced, so the server never learns who took part); local DP refuses it."""


def round_release(
    privatizer: Privatizer,
    value: Tensor,
    *,
    correlated: CorrelatedNoise | None,
    per_unit_bound: float,
    noise_multiplier: float,
    stream: str,
    step: int,
    name: str,
    round: int,
    units: str = ALL_UNITS,
    params: dict[str, Any] | None = None,
    sampling_probability: float = 1.0,
) -> Tensor:
    """One round's release of a gradient stream (FedRep's G, NoisyGD's and NoisyHead's gradient sums):
    step ``step`` of the stream's correlated noise when the run has a correlated strategy, else an
    independent Gaussian touching ``units`` (the round's cohort), Poisson-sampled at
    ``sampling_probability``. One place decides between the two, so the protocols cannot drift apart."""
    if correlated is not None:
        return privatizer.correlated_gaussian_sum(
            value,
            per_unit_bound=per_unit_bound,
            noise_multiplier=noise_multiplier,
            noise=correlated,
            stream=stream,
            step=step,
            name=name,
            round=round,
            params=params,
        )
    return privatizer.gaussian_sum(
        value,
        per_unit_bound=per_unit_bound,
        noise_multiplier=noise_multiplier,
        name=name,
        round=round,
        units=units,
        params=params,
        sampling_probability=sampling_probability,
    )


class Protocol(abc.ABC):
    """An algorithm of the billboard model. Subclasses are plain data plus pure functions."""

    name: str = "protocol"

    @property
    @abc.abstractmethod
    def num_rounds(self) -> int:
        """Number of client→server rounds."""

    @abc.abstractmethod
    def initial_state(self) -> State:
        """Server state before round 0 (public)."""

    def server_start(self, state: State, privatizer: Privatizer) -> State:
        """Server-side additions to the initial state drawn from the Privatizer's private
        generators (e.g. round 0's Poisson sample), once per fresh run. Default: none."""
        return state

    @abc.abstractmethod
    def broadcast(self, state: State, round: int) -> dict[str, Tensor]:
        """Public tensors sent to every client in ``round``."""

    @abc.abstractmethod
    def stat_specs(self, round: int) -> tuple[StatSpec, ...]:
        """Statistics clients return in ``round``, with per-unit bounds."""

    @abc.abstractmethod
    def client_update(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> Message:
        """Per-unit statistics, clipped per unit, summed over ``units``. Never adds noise."""

    @abc.abstractmethod
    def server_update(
        self, round: int, state: State, summed: Message, privatizer: Privatizer
    ) -> tuple[State, dict[str, float]]:
        """Privatise the summed message (through ``privatizer`` only) and return (new state, diagnostics)."""

    def unit_keys(self) -> tuple[str, ...]:
        """Names of the per-unit tensors ``client_update`` reads (besides ``ids``)."""
        return ()

    def node_side(self) -> NodeSide | str:
        """Distributed and local DP: this configuration's :class:`NodeSide` declaration, or why its releases
        cannot be noised on the nodes (a reason the runtime's refusal quotes). Default: not declared."""
        return f"{self.name} (it declares no node-side releases: see docs/contributing.md, Trust models)"

    def unit_statistics(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> UnitStatistics | None:
        """Each unit's own contribution, batched over ``units`` (:class:`UnitStatistics`): what
        ``client_update`` sends for each taking-part unit alone, the same bits, computed for the batch at once
        (distributed and local DP encode each unit on its node). None: not provided, so the runtime calls
        ``client_update`` on each unit alone (correct, and about 3 ms a unit). Default: None."""
        return None

    def with_noise_multiplier(self, noise_multiplier: float) -> Protocol:
        """This protocol assuming ``noise_multiplier`` after its releases (its PSD floor, its noise
        diagnostics: public post-processing), as distributed and local DP set it to the nodes' noise. Default:
        the dataclass field ``noise_multiplier`` replaced (a protocol declaring :class:`NodeSide` has one)."""
        if not dataclasses.is_dataclass(self) or "noise_multiplier" not in {f.name for f in dataclasses.fields(self)}:
            raise TypeError(f"{self.name}: with_noise_multiplier needs a dataclass field noise_multiplier")
        return cast(Protocol, dataclasses.replace(cast(Any, self), noise_multiplier=noise_multiplier))

    def units_needed(self, round: int, broadcast: Mapping[str, Tensor]) -> tuple[Tensor | None, tuple[int, int] | None]:
        """(ids, samples) ``client_update`` reads in ``round``: the units that take part (None: all)
        and the range [a, b) of their samples (None: all), so a source that makes its units on
        demand can make only those. Default: everything."""
        return None, None

    def units_in_round(self, round: int, units: Units) -> int:
        """How many of ``units`` take part in ``round`` (the ``count`` their message carries)."""
        return int(units["ids"].shape[0])

    def planned_units(self, round: int, spans: Iterable[range]) -> int:
        """The units the public plan gives the unit-id ranges ``spans`` in ``round``
        (:meth:`units_in_round` of each range's ids): a function of the plan alone (under Poisson cohorts,
        those eligible before any draw, never |S|)."""
        return sum(self.units_in_round(round, {"ids": torch.arange(span.start, span.stop)}) for span in spans)

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the statistics: a protocol's ``dtype_name`` field, float64 by default."""
        return getattr(torch, getattr(self, "dtype_name", "float64"))
