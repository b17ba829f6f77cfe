"""The run contract: every algorithm's config is a RunConfig (seed, ε, chunk size, device declared
once), keeps its own field order, and takes an inherited field's default and help from its base."""

from __future__ import annotations

import dataclasses

import pytest

from fedpers import config as config_lib
from fedpers.config import ApproxDpRunConfig, DeviceRunConfig, Neighbours, RunConfig, field, inherited, run_config
from fedpers.experiments import ALGORITHMS, experiment


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_config_is_a_run_config_with_typed_run_fields(name: str) -> None:
    cls = experiment(name).config_type
    cfg = cls()
    assert isinstance(cfg, RunConfig)
    assert isinstance(cfg.seed, int) and isinstance(cfg.epsilon, float) and isinstance(cfg.chunk_size, int)
    assert cfg.device == "cpu"
    assert list(config_lib.to_dict(cfg)) == [f.name for f in dataclasses.fields(cls)]


def test_an_approximate_dp_run_has_delta_and_the_pure_one_does_not() -> None:
    has_delta = {name for name in ALGORITHMS if issubclass(experiment(name).config_type, ApproxDpRunConfig)}
    assert has_delta == set(ALGORITHMS) - {"expmech"}


def test_fields_keep_the_order_the_class_lists_and_inherited_ones_their_base_help() -> None:
    @run_config
    class Toy(DeviceRunConfig):
        size: int = field(3, "how many", ge=1)
        epsilon: float = field(2.0, "toy ε", gt=0.0)
        seed: int = inherited()
        delta: float = inherited()
        kernels: str = inherited()
        device: str = inherited()
        dtype: str = field("float32", "toy dtype")
        chunk_size: int = inherited()
        neighbours: Neighbours = inherited()

    assert [f.name for f in dataclasses.fields(Toy)] == [
        "size",
        "epsilon",
        "seed",
        "delta",
        "kernels",
        "device",
        "dtype",
        "chunk_size",
        "neighbours",
    ]
    fields = {f.name: f for f in dataclasses.fields(Toy)}
    base = {f.name: f for f in dataclasses.fields(DeviceRunConfig)}
    assert fields["device"].metadata == base["device"].metadata and fields["dtype"].metadata["help"] == "toy dtype"
    cfg = config_lib.build(Toy, {"size": 5, "device": "cpu", "epsilon": "3"})
    assert (cfg.size, cfg.epsilon, cfg.dtype, cfg.delta) == (5, 3.0, "float32", 1e-5)
    with pytest.raises(ValueError, match=r"epsilon must be > 0\.0"):
        config_lib.build(Toy, {"epsilon": 0.0})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.size = 4  # type: ignore[misc]  # frozen: the point of the assertion


def test_a_config_that_leaves_an_inherited_field_unlisted_is_refused() -> None:
    with pytest.raises(TypeError, match="must list its inherited field"):

        @run_config
        class Partial(RunConfig):
            size: int = field(3, "how many")
            seed: int = inherited()
