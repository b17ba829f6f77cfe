"""The lab's privacy policy for a Flower deployment, enforced by the ServerApp and by every node.

A deployment's run-config comes from whoever submits the run; the policy comes from the lab, as a
TOML file on each machine (``$FEDPERS_POLICY``), so what a release may cost is the lab's decision,
not the submitter's::

    federation = "lab-2026"           # names the budget ledger below
    max-epsilon = 8.0                 # per user, summed over every run of this federation
    max-delta = 1e-5                  # per user, summed over every run of this federation
    require-secure-noise = true       # the ServerApp refuses secure-noise=false (seeded noise)
    min-units = 50                    # no node computes a message over fewer users
    algorithms = ["altmin", "dpals"]  # what may run
    max-rounds = 1000                 # no run has more rounds (default 1000)
    max-seconds = 86400.0             # no round starts after this many seconds of a run (default: a day)
    ledger = "budget.json"            # the federation's budget ledger (relative to this file;
                                      # default: FEDERATION-budget.json beside it)
    trust-model = "distributed"       # nodes: the weakest trust model their users accept (central <
                                      # distributed < local; default central)
    min-nodes = 3                     # nodes: the fewest survivors a distributed plan may size shares for
    collusion = 1                     # nodes: the fewest colluding nodes a distributed plan's shares tolerate
                                      # (default 0)
    bits = [16, 20, 24, 32]           # nodes: the bits of a distributed plan they accept (default: any)

Runs compose by basic composition (ε and δ add up): a user's spent budget is the sum of the
(target) ε, δ of every run that included them, unit ids naming the same users across the runs of
one federation. :class:`BudgetLedger` charges a run before its first release and refuses one that
would take any user above the policy; a charged run is never refunded (its releases may have
happened). See docs/flower.md (Security) for who enforces which rule.

Every refusal is a :class:`PolicyRefused` naming the rule.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POLICY_ENV = "FEDPERS_POLICY"
"""Path of the lab's policy TOML on this machine (SuperExec and SuperNode inherit it); unset: no policy."""

_KEYS = (
    "federation",
    "max-epsilon",
    "max-delta",
    "require-secure-noise",
    "min-units",
    "algorithms",
    "ledger",
    "max-rounds",
    "max-seconds",
    "trust-model",
    "min-nodes",
    "collusion",
    "bits",
)
TRUST_MODELS = ("central", "distributed", "local")
"""The trust models, weakest first: a node whose policy requires one accepts it or a stronger one."""


class PolicyRefused(ValueError):
    """A run or a task refused by the lab's policy or by a node's own rules; ``rule`` names the rule it breaks
    (a policy key, ``plan-*`` for the run's public plan, ``trust-model``/``node-noise`` for the node's trust
    model, ``secagg-*`` for SecAgg+)."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"lab policy, rule {rule!r}: {message}")
        self.rule = rule


@dataclass(frozen=True)
class Policy:
    """The lab's limits (see the module docstring for the file format)."""

    federation: str
    max_epsilon: float
    max_delta: float
    require_secure_noise: bool = True
    min_units: int = 1
    algorithms: tuple[str, ...] = ()
    ledger: Path | None = None
    max_rounds: int = 1000
    max_seconds: float = 86400.0
    trust_model: str = "central"
    """The weakest trust model this node's users accept (:data:`TRUST_MODELS`)."""
    min_nodes: int = 1
    """The fewest survivors a distributed plan may size its noise shares for (a smaller one puts more of
    the noise on each node's share the server could learn with fewer colluders)."""
    bits: tuple[int, ...] = ()
    """The bits of a distributed plan this node accepts (empty: any)."""
    collusion: int = 0
    """The fewest colluding nodes a distributed plan's noise shares must tolerate (shares sized for
    min_nodes − collusion honest survivors)."""

    def __post_init__(self) -> None:
        if not self.federation or not self.federation.replace("-", "").replace("_", "").isalnum():
            raise ValueError(
                f"policy federation must be a non-empty name of letters, digits, - and _; got {self.federation!r}"
            )
        if not (self.max_epsilon > 0 and math.isfinite(self.max_epsilon)):
            raise ValueError(f"policy max-epsilon must be finite and > 0; got {self.max_epsilon}")
        if not 0 < self.max_delta < 1:
            raise ValueError(f"policy max-delta must be in (0, 1); got {self.max_delta}")
        if self.min_units < 1:
            raise ValueError(f"policy min-units must be an integer >= 1; got {self.min_units}")
        if not self.algorithms:
            raise ValueError("policy algorithms must list at least one algorithm")
        if self.max_rounds < 1:
            raise ValueError(f"policy max-rounds must be an integer >= 1; got {self.max_rounds}")
        if not (self.max_seconds > 0 and math.isfinite(self.max_seconds)):
            raise ValueError(f"policy max-seconds must be finite and > 0; got {self.max_seconds}")
        if self.trust_model not in TRUST_MODELS:
            raise ValueError(f"policy trust-model must be one of {list(TRUST_MODELS)}; got {self.trust_model!r}")
        if self.min_nodes < 1:
            raise ValueError(f"policy min-nodes must be an integer >= 1; got {self.min_nodes}")
        if not (isinstance(self.collusion, int) and self.collusion >= 0):
            raise ValueError(f"policy collusion must be an integer >= 0; got {self.collusion}")
        if not all(4 <= b <= 32 for b in self.bits):
            raise ValueError(f"policy bits must list integers in [4, 32]; got {list(self.bits)}")


def load_policy(path: str | Path) -> Policy:
    """Read a policy TOML; a malformed file is a ValueError naming the key (the run is refused)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{POLICY_ENV}: cannot read the policy {path}: {e}") from None
    unknown = sorted(set(raw) - set(_KEYS))
    missing = sorted({"federation", "max-epsilon", "max-delta", "algorithms"} - set(raw))
    if unknown or missing:
        raise ValueError(f"policy {path}: unknown keys {unknown}, missing keys {missing}; keys: {list(_KEYS)}")
    algorithms = raw["algorithms"]
    if not isinstance(algorithms, list) or not all(isinstance(a, str) for a in algorithms):
        raise ValueError(f"policy algorithms must be a list of names; got {algorithms!r}")
    bits = raw.get("bits", [])
    if not isinstance(bits, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in bits):
        raise ValueError(f"policy bits must be a list of integers in [4, 32]; got {bits!r}")
    for key, kind in (
        ("max-epsilon", (int, float)),
        ("max-delta", (int, float)),
        ("min-units", int),
        ("max-rounds", int),
        ("max-seconds", (int, float)),
        ("require-secure-noise", bool),
        ("federation", str),
        ("ledger", str),
        ("trust-model", str),
        ("min-nodes", int),
        ("collusion", int),
    ):
        if key in raw and (not isinstance(raw[key], kind) or (kind is int and isinstance(raw[key], bool))):
            raise ValueError(f"policy {key} has the wrong type: {raw[key]!r}")
    ledger = raw.get("ledger")
    return Policy(
        federation=raw["federation"],
        max_epsilon=float(raw["max-epsilon"]),
        max_delta=float(raw["max-delta"]),
        require_secure_noise=raw.get("require-secure-noise", True),
        min_units=raw.get("min-units", 1),
        algorithms=tuple(algorithms),
        ledger=(path.parent / (ledger or f"{raw['federation']}-budget.json")).resolve(),
        max_rounds=raw.get("max-rounds", 1000),
        max_seconds=float(raw.get("max-seconds", 86400.0)),
        trust_model=raw.get("trust-model", "central"),
        min_nodes=raw.get("min-nodes", 1),
        collusion=raw.get("collusion", 0),
        bits=tuple(bits),
    )


def active_policy() -> Policy | None:
    """The policy named by ``$FEDPERS_POLICY`` (None when unset)."""
    path = os.environ.get(POLICY_ENV, "")
    return load_policy(path) if path else None


def _privacy(config: Mapping[str, Any] | Any) -> tuple[float, float]:
    """(ε, δ) a config targets; an algorithm without them is non-private (ε = ∞)."""
    get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
    epsilon, delta = get("epsilon", math.inf), get("delta", 1.0)
    return float(epsilon), float(delta)


def check_run(
    policy: Policy, algorithm: str, config: Mapping[str, Any] | Any, *, secure_noise: bool
) -> tuple[float, float]:
    """The ServerApp's check, before any work: the run's algorithm, its ε and δ alone, its noise.

    Returns the run's (ε, δ) for :meth:`BudgetLedger.charge` (which checks the cumulative budget)."""
    if algorithm not in policy.algorithms:
        raise PolicyRefused("algorithms", f"{algorithm!r} is not allowed; allowed: {list(policy.algorithms)}")
    epsilon, delta = _privacy(config)
    if not epsilon <= policy.max_epsilon:
        raise PolicyRefused(
            "max-epsilon",
            f"the run asks for epsilon={epsilon}, the lab allows at most {policy.max_epsilon} per user over all runs",
        )
    if not delta <= policy.max_delta:
        raise PolicyRefused(
            "max-delta",
            f"the run asks for delta={delta}, the lab allows at most {policy.max_delta} per user over all runs",
        )
    if policy.require_secure_noise and not secure_noise:
        raise PolicyRefused(
            "require-secure-noise", "secure-noise=false (noise reproducible from a seed) is not allowed"
        )
    return epsilon, delta


def check_task(policy: Policy, algorithm: str, config: Mapping[str, Any], units: int) -> None:
    """A node's check of every task, before it computes: the algorithm, the run's ε and δ, and
    the number of units (users) the message would be computed over."""
    if algorithm not in policy.algorithms:
        raise PolicyRefused(
            "algorithms", f"{algorithm!r} is not allowed on this node; allowed: {list(policy.algorithms)}"
        )
    epsilon, delta = _privacy(config)
    if not epsilon <= policy.max_epsilon:
        raise PolicyRefused(
            "max-epsilon", f"the task's run has epsilon={epsilon}, the lab allows at most {policy.max_epsilon}"
        )
    if not delta <= policy.max_delta:
        raise PolicyRefused("max-delta", f"the task's run has delta={delta}, the lab allows at most {policy.max_delta}")
    if units < policy.min_units:
        raise PolicyRefused(
            "min-units", f"the task asks for a message over {units} users, the lab's minimum is {policy.min_units}"
        )


def check_trust(policy: Policy, dp_model: str, min_nodes: int, collusion: int = 0) -> None:
    """A node's check of the run's trust model (the job's, pinned for the run) against its own policy, before
    any computation: a model weaker than the one its users require, or a distributed plan sized for fewer
    survivors than its ``min-nodes``, is refused."""
    if TRUST_MODELS.index(dp_model) < TRUST_MODELS.index(policy.trust_model):
        raise PolicyRefused(
            "trust-model",
            f"the run's dp_model is {dp_model}; this node's users require {policy.trust_model} or stronger "
            f"({' < '.join(TRUST_MODELS)})",
        )
    if dp_model == "distributed" and min_nodes < policy.min_nodes:
        raise PolicyRefused(
            "min-nodes",
            f"the run's noise shares are sized for min_nodes={min_nodes} survivors; this node accepts no fewer "
            f"than {policy.min_nodes}",
        )
    if dp_model == "distributed" and collusion < policy.collusion:
        raise PolicyRefused(
            "collusion",
            f"the run's noise shares tolerate collusion={collusion} nodes colluding with the server; this node "
            f"requires at least {policy.collusion}",
        )


def check_bits(policy: Policy, bits: int) -> None:
    """A node's check of a distributed plan's bits (as the node derives the plan) against its policy."""
    if policy.bits and bits not in policy.bits:
        raise PolicyRefused(
            "bits", f"the run's distributed plan has bits={bits}; this node accepts {list(policy.bits)}"
        )


def check_partitions(policy: Policy, sizes: Mapping[int, int]) -> None:
    """The ServerApp's check of the split (partition → number of units) before the first round."""
    small = {p: n for p, n in sorted(sizes.items()) if n < policy.min_units}
    if small:
        raise PolicyRefused(
            "min-units", f"partitions {small} hold fewer users than the lab's minimum {policy.min_units}"
        )


@dataclass(frozen=True)
class Charge:
    """One run's entry in a federation's budget ledger."""

    run: str
    epsilon: float
    delta: float
    units: tuple[int, int]
    time: float

    @classmethod
    def from_json(cls, c: Mapping[str, Any]) -> Charge:
        """A charge as a ledger file stores it (a malformed entry raises KeyError, TypeError or ValueError)."""
        return cls(
            c["run"], float(c["epsilon"]), float(c["delta"]), (int(c["units"][0]), int(c["units"][1])), float(c["time"])
        )


class BudgetStore:
    """The one store of a federation's spent budget, and the one budget check: a JSON file
    ``{federation, composition, charges, ...}`` that the federation's ledger (:class:`BudgetLedger`, on the
    ServerApp's side) and every node's ledger (:class:`~fedpers.runtime.flower.nodeplan.NodeLedger`) are
    views of. Read and rewritten whole under an exclusive lock (0600 files in a 0700 directory): two
    charges at once cannot both take the last of a user's budget, and a refused one writes nothing."""

    def __init__(self, path: str | Path, federation: str, what: str = "budget ledger") -> None:
        self.path, self.federation, self.what = Path(path), federation, what

    def read(self) -> dict[str, Any]:
        """The file's content (an empty store when there is none); a ValueError naming the file when it is
        not one of this federation's (no charge can be made until it is repaired)."""
        if not self.path.exists():
            return {"federation": self.federation, "composition": COMPOSITION, "charges": []}
        try:
            raw = json.loads(self.path.read_text())
            if not isinstance(raw, dict) or raw.get("federation") != self.federation:
                found = raw.get("federation") if isinstance(raw, dict) else None
                raise ValueError(f"it belongs to federation {found!r}, not {self.federation!r}")
            if not isinstance(raw.get("charges"), list):
                raise ValueError("its charges are missing")
            self.charges_of(raw)
            return raw
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            raise ValueError(
                f"{self.what} {self.path}: unreadable ({e}); no run can be charged until it is repaired"
            ) from None

    @staticmethod
    def charges_of(raw: Mapping[str, Any]) -> list[Charge]:
        return [Charge.from_json(c) for c in raw["charges"]]

    def charges(self) -> list[Charge]:
        return self.charges_of(self.read())

    def spent(self, units: tuple[int, int]) -> tuple[float, float]:
        """The most (ε, δ) any user with id in ``[units[0], units[1])`` has spent (ε and δ each maximised)."""
        return _max_over(self.charges(), units)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[dict[str, Any]]:
        """The store's content under the lock; what the block leaves in it is written (atomically) when it
        ends without an exception, nothing otherwise."""
        import fcntl

        from fedpers.results.securefs import private_dir, write_private

        private_dir(self.path.parent)
        fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = self.read()
            yield raw
            write_private(self.path, (json.dumps(raw, indent=1) + "\n").encode())
        finally:
            os.close(fd)

    def check(
        self, policy: Policy, raw: Mapping[str, Any], units: tuple[int, int], epsilon: float, delta: float, who: str
    ) -> None:
        """The budget check: a charge of (``epsilon``, ``delta``) to users ``units`` that would take any of them
        past the policy, or that is not a finite number, is refused (:class:`PolicyRefused`) naming ``who``."""
        eps, dl = _max_over(self.charges_of(raw), units)
        where = f"federation {self.federation!r}: users in {list(units)}"
        if not (math.isfinite(epsilon) and epsilon >= 0 and eps + epsilon <= policy.max_epsilon * (1 + 1e-12)):
            raise PolicyRefused(
                "max-epsilon",
                f"{where} have spent epsilon={eps:g}; {who}'s {epsilon:g} would exceed the lab's {policy.max_epsilon:g}",
            )
        if not (math.isfinite(delta) and delta >= 0 and dl + delta <= policy.max_delta * (1 + 1e-12)):
            raise PolicyRefused(
                "max-delta",
                f"{where} have spent delta={dl:g}; {who}'s {delta:g} would exceed the lab's {policy.max_delta:g}",
            )

    @staticmethod
    def record(raw: dict[str, Any], run: str, units: tuple[int, int], epsilon: float, delta: float) -> Charge:
        """Append a checked charge to ``raw`` (inside :meth:`transaction`)."""
        new = Charge(run, epsilon, delta, units, time.time())
        raw["charges"].append(new.__dict__ | {"units": list(new.units)})
        return new


COMPOSITION = "basic (epsilon and delta add up)"


class BudgetLedger(BudgetStore):
    """The federation's view (the ServerApp's user alone may write it): one charge per run, before its
    first release, refused if any user would exceed the policy; a charged run is never refunded."""

    def charge(self, policy: Policy, run: str, units: tuple[int, int], epsilon: float, delta: float) -> Charge:
        """Record ``run``'s (ε, δ) for users ``units``; refused (nothing written) if any of them would
        exceed the policy. A run already charged (a resumed run) is not charged again."""
        if units[0] < 0 or units[1] <= units[0]:
            raise ValueError(f"units must be a non-empty range of ids; got {units}")
        with self.transaction() as raw:
            for c in self.charges_of(raw):
                if c.run == run:
                    return c
            self.check(policy, raw, units, epsilon, delta, f"run {run}")
            return self.record(raw, run, units, epsilon, delta)


def _max_over(charges: list[Charge], units: tuple[int, int]) -> tuple[float, float]:
    lo, hi = units
    points = sorted({lo, *(c.units[0] for c in charges if lo < c.units[0] < hi)})
    best_e = best_d = 0.0
    for p in points:  # the spent budget is constant between these breakpoints
        covering = [c for c in charges if c.units[0] <= p < c.units[1]]
        best_e = max(best_e, sum(c.epsilon for c in covering))
        best_d = max(best_d, sum(c.delta for c in covering))
    return best_e, best_d


def admit_run(policy: Policy, job: Any, run_id: str) -> Charge:
    """The ServerApp's gate, before any work: ``job`` (a run-config's ServerJob) within the policy,
    then charged to the federation's ledger (refused if a user would exceed the budget). A resumed
    run is admitted only if the ledger already holds its charge (keyed by its run directory)."""
    if policy.ledger is None:
        raise ValueError("policy has no ledger path: load it with load_policy")
    ledger = BudgetLedger(policy.ledger, policy.federation)
    if job.resume is not None:
        key = str(Path(job.resume).resolve())
        for c in ledger.charges():
            if c.run.split("|")[0] == key:
                return c
        raise PolicyRefused(
            "max-epsilon",
            f"resume {key}: the federation's ledger holds no charge for this run, so its budget is unknown",
        )
    epsilon, delta = check_run(policy, job.experiment.name, job.cfg, secure_noise=bool(job.options.secure_noise))
    key = f"{Path(job.out).resolve() if job.out is not None else ''}|flwr-run-{run_id}"  # a reused out directory is charged again
    return ledger.charge(policy, key, (0, int(job.experiment.num_units(job.cfg))), epsilon, delta)
