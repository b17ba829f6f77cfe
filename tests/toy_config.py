"""The toy algorithm's config (docs/contributing.md's worked example), in a module of its own as every
algorithm's is (fedpers/configs/): it imports neither torch nor an accounting library, so ``fedpers run
toymean`` lists its flags and refuses a bad value before anything heavy is imported."""

from __future__ import annotations

from fedpers.config import MAX_EPSILON, ApproxDpRunConfig, Neighbours, field, inherited, run_config
from fedpers.configs.privacy import Accountant, accountant_field, check_accountant


@run_config
class ToyMeanConfig(ApproxDpRunConfig):
    n_users: int = field(200, "users n", ge=1)
    dim: int = field(4, "vector dimension d", ge=1)
    rounds: int = field(2, "rounds (one Gaussian release each)", ge=1)
    clip: float = field(2.0, "per-user clip C of the vector", gt=0.0)
    epsilon: float = field(4.0, "user-level ε (inf: no noise)", gt=0.0, le=MAX_EPSILON, inf_ok=True)
    delta: float = field(1e-5, "user-level δ", gt=0.0, lt=1.0)
    accountant: str = accountant_field(Accountant.PLD, "privacy accountant")
    seed: int = inherited()
    chunk_size: int = inherited()
    neighbours: Neighbours = inherited()

    def check(self) -> None:
        check_accountant(self.accountant, self.neighbours)
