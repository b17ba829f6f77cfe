"""Shared by the tests that recompute cohorts from the config or guard the device generation path."""

from __future__ import annotations

import torch

from fedpers.data import synthetic


def cohort_permutation_from_config(cfg, seed: int) -> tuple[torch.Tensor, int]:
    """(permutation, cohort block): the public cohort permutation recomputed from the config alone under the documented auto
    rule (runs of 1,024 ids for 65,536 synthetic users or more, single users below), not read off
    the protocol object."""
    n = cfg.n_users
    g = torch.Generator().manual_seed(seed)
    block = cfg.cohort_block or (1024 if cfg.data is None and n >= 65536 else 1)
    if block == 1:
        return torch.randperm(n, generator=g), block
    runs = torch.randperm(-(-n // block), generator=g)  # runs of `block` consecutive ids
    perm = (runs[:, None] * block + torch.arange(block)).flatten()
    return perm[perm < n], block


def forbid_host_generation(monkeypatch) -> list[torch.device]:
    """Make the float64 host block generator raise and record the device of every keyed generator
    made: the list the caller checks once its draw has run."""

    def host(*args, **kwargs):
        raise AssertionError("host-side generation on the device path")

    devices: list[torch.device] = []
    real = synthetic._generator

    def spy(seed, *key, device="cpu"):
        devices.append(torch.device(device))
        return real(seed, *key, device=device)

    monkeypatch.setattr(synthetic, "_user_block", host)
    monkeypatch.setattr(synthetic, "_generator", spy)
    return devices
