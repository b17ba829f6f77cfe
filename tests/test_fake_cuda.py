"""The fake CUDA device (tests/fake_cuda.py) catches what a real GPU run would hit first, and lets clean code run."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import scipy.linalg
import torch

from fedpers import linalg, metrics, pools
from fedpers.data import synthetic
from tests.fake_cuda import FakeCudaGenerator, fake_cuda, on_device

MIXING = "Expected all tensors to be on the same device"


def test_torch_sees_one_cuda_device_and_everything_is_restored_after():
    real_generator, real_submit, available = torch.Generator, ThreadPoolExecutor.submit, torch.cuda.is_available()
    with fake_cuda():
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        assert torch.cuda.get_device_name(0) == "fake" and torch.cuda.mem_get_info()[0] > 0
        torch.cuda.synchronize()
        x = torch.zeros(3, device="cuda")
        assert x.device == torch.device("cuda", 0) and x.is_cuda and on_device(x)
        assert torch.ones(2).device.type == "cpu" and not torch.ones(2).is_cuda
        assert synthetic.uses_parts_scheme(torch.float64, x.device)  # the code takes its GPU branches
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.zeros(1, device="cuda:1")
    assert torch.Generator is real_generator and ThreadPoolExecutor.submit is real_submit
    assert torch.cuda.is_available() == available


def test_tensors_put_on_cuda_stay_there_and_come_back_untagged():
    with fake_cuda():
        host = torch.arange(6.0).reshape(2, 3)
        for dev in (
            host.cuda(),
            host.to("cuda"),
            host.to(device="cuda", dtype=torch.float32),
            torch.tensor([1.0], device="cuda"),
        ):
            assert dev.is_cuda
        dev = host.to("cuda")
        assert dev.to("cuda") is dev and dev.double().is_cuda and (dev @ dev.T).is_cuda
        assert torch.zeros_like(dev).is_cuda and dev.new_zeros(4).is_cuda and torch.empty(2, device=dev.device).is_cuda
        assert all(t.is_cuda for t in torch.linalg.eigh(dev @ dev.T)) and dev[0].is_cuda and dev.sum().is_cuda
        back = dev.cpu()
        assert back.device.type == "cpu" and not on_device(back) and torch.equal(back, host)
        assert not dev.to("cpu").is_cuda and not torch.zeros_like(dev, device="cpu").is_cuda and not host.to(dev).is_cpu


def test_a_planted_mixing_bug_raises_as_on_cuda():
    def planted(x: torch.Tensor) -> torch.Tensor:  # the identity made on the host, as fedpers' evaluators did with U*
        return x @ torch.eye(x.shape[-1], dtype=x.dtype)

    def clean(x: torch.Tensor) -> torch.Tensor:
        return x @ torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)

    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    with fake_cuda():
        dev = x.to("cuda")
        with pytest.raises(RuntimeError, match=MIXING):
            planted(dev)
        assert torch.equal(clean(dev).cpu(), x)
        total = torch.zeros(3, dtype=torch.float64)  # a host accumulator of device statistics
        with pytest.raises(RuntimeError, match=MIXING):
            total += dev.sum(0).double()
        for bad in (lambda: dev + x, lambda: torch.cat([dev, x]), lambda: torch.stack([dev.sum(), x.sum()])):
            with pytest.raises(RuntimeError, match=MIXING):
                bad()
        with ThreadPoolExecutor(1) as pool:  # torch's modes are per thread: the fake follows work to workers
            with pytest.raises(RuntimeError, match=MIXING):
                pool.submit(planted, dev).result()
        assert list(pools.pool(2).map(lambda t: clean(t).is_cuda, [dev, dev])) == [True, True]


def test_what_cuda_allows_across_devices_is_allowed_and_what_it_refuses_raises():
    with fake_cuda():
        dev = torch.arange(6.0, device="cuda")
        scalar = torch.tensor(2.0)  # a 0-dim host tensor: one may enter an elementwise kernel
        assert (
            (dev * scalar).is_cuda
            and torch.clamp(dev, max=scalar).is_cuda
            and torch.where(dev > 2, dev, scalar).is_cuda
        )
        idx, mask = torch.tensor([0, 2]), torch.tensor([True, False] * 3)
        assert dev[idx].is_cuda and dev[mask].is_cuda  # host index tensors are copied to the device
        dev[idx] = scalar
        dev[1:3] = torch.tensor([7.0, 8.0])  # a slice assignment is a copy_, across devices allowed
        dev.fill_(torch.tensor(1.0))
        assert float(dev.sum()) == 6.0 and dev.sum().item() == 6.0 and dev.tolist() == [1.0] * 6
        host = torch.zeros(3)
        host[torch.tensor([1])] = dev.sum()  # a 0-dim device value is read to the host
        assert not host.is_cuda and host.tolist() == [0.0, 6.0, 0.0]
        assert not torch.as_tensor(dev, device="cpu").is_cuda and dev.is_cuda
        with pytest.raises(RuntimeError, match="too many CPU scalars"):
            torch.where(dev > 0, scalar, torch.tensor(3.0))
        with pytest.raises(RuntimeError, match=MIXING):  # a host scalar may be an input, never the output
            scalar.add_(dev.sum())
        with pytest.raises(RuntimeError, match=MIXING):  # and only elementwise kernels take it
            torch.index_select(dev, 0, torch.tensor(0))
        with pytest.raises(RuntimeError, match="indices should be either on cpu or on the same device"):
            torch.arange(6.0)[idx.to("cuda")]
        with pytest.raises(RuntimeError, match=MIXING):
            dev[idx] = torch.tensor([1.0, 2.0])


def test_a_planted_wrong_device_generator_raises():
    with fake_cuda():
        host_g, dev_g = torch.Generator().manual_seed(3), torch.Generator(device="cuda").manual_seed(3)
        assert isinstance(dev_g, (torch.Generator, FakeCudaGenerator)) and dev_g.device.type == "cuda"
        with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator but found 'cpu'"):
            torch.randn(4, generator=host_g, device="cuda")
        with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator but found 'cuda'"):
            torch.randn(4, generator=dev_g)
        with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator but found 'cuda'"):
            torch.randperm(4, generator=dev_g)
        with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator but found 'cpu'"):
            torch.empty(4, device="cuda").normal_(generator=host_g)
        with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator but found 'cpu'"):
            torch.randn(4, generator=host_g, out=torch.empty(4, device="cuda"))
        drawn = torch.randn(4, generator=dev_g, device=dev_g.device)
        assert drawn.is_cuda and torch.randint(5, (3,), generator=dev_g, device="cuda").is_cuda
    # the fake's device draws are the CPU generator's (Mersenne Twister), not CUDA's Philox
    assert torch.equal(drawn.cpu(), torch.randn(4, generator=torch.Generator().manual_seed(3)))


def test_a_planted_numpy_call_raises():
    with fake_cuda():
        dev = torch.ones(2, 2, device="cuda")
        for planted in (dev.numpy, lambda: np.asarray(dev), lambda: scipy.linalg.cholesky(dev)):
            with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy"):
                planted()
        assert np.array_equal(dev.cpu().numpy(), np.ones((2, 2))) and dev.numpy(force=True).shape == (2, 2)


def test_what_cuda_kernels_lack_raises():
    """Integer matrix products (no cuBLAS kernel) and lstsq drivers other than gels, which the CPU has."""
    a = torch.arange(6).reshape(2, 3)
    with fake_cuda():
        dev = a.to("cuda")
        with pytest.raises(RuntimeError, match="not implemented for 'Long'"):
            dev @ dev.T
        assert torch.equal((dev.double() @ dev.T.double()).cpu(), (a @ a.T).double())
        A, b = (
            torch.randn(5, 2, dtype=torch.float64, device="cuda"),
            torch.randn(5, 1, dtype=torch.float64, device="cuda"),
        )
        with pytest.raises(RuntimeError, match="other than `gels` is not supported on CUDA"):
            torch.linalg.lstsq(A, b, driver="gelsd")
        x = torch.linalg.lstsq(A, b).solution  # gels, as CUDA: full-rank A solved by QR
        assert x.is_cuda and torch.allclose(x.cpu(), torch.linalg.lstsq(A.cpu(), b.cpu(), driver="gelsd").solution)


def test_copies_and_syncs_are_counted_with_the_fedpers_line_that_made_them():
    u = synthetic.subspace(0, 5, 2)
    with fake_cuda() as fc:
        dev = u.to("cuda")  # a blocking copy: PyTorch synchronises the stream after it
        assert (fc.traffic.h2d, fc.traffic.d2h, fc.traffic.h2d_bytes, fc.traffic.syncs) == (1, 0, u.numel() * 8, 1)
        assert metrics.subspace_error(dev, dev) < 1e-12  # float(): the host waits for the device
        assert fc.traffic.syncs == 2 and ("sync", "fedpers/metrics.py:13 subspace_error") in fc.traffic.sites
        dev.cpu()
        dev[torch.tensor([0])]
        assert (fc.traffic.h2d, fc.traffic.d2h, fc.traffic.syncs) == (2, 1, 4)
        assert "fedpers/metrics.py:13 subspace_error" in fc.traffic.report()
        fc.traffic.reset()
        linalg.orthonormal_basis(dev)
        assert fc.traffic.h2d == fc.traffic.d2h == fc.traffic.syncs == 0 and fc.traffic.launches > 0


def test_every_read_of_the_device_is_a_sync_and_a_pinned_non_blocking_copy_is_not():
    """What makes the host wait on a GPU: reads of values, ops whose output size or error check the
    host needs, blocking copies; what does not: kernels queued on the device, a non-blocking copy from
    pinned memory."""
    x = torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    spd = x @ x.T + torch.eye(6, dtype=torch.float64)
    with fake_cuda() as fc:
        dev, a = x.to("cuda"), spd.to("cuda")
        waits = {
            "item": lambda: dev.sum().item(),
            "bool": lambda: bool(dev.sum() > 0),
            "tolist": lambda: dev[0].tolist(),
            "cpu": lambda: dev.cpu(),
            "nonzero": lambda: (dev > 0).nonzero(),
            "mask index": lambda: dev[dev > 0],
            "mask assign": lambda: dev.clone().__setitem__(dev > 0, 1.0),
            "equal": lambda: torch.equal(dev, dev),
            "unique": lambda: torch.unique(dev),
            "repeat_interleave": lambda: torch.repeat_interleave(torch.ones(3, dtype=torch.int64, device="cuda")),
            "eigh": lambda: torch.linalg.eigh(a),
            "solve": lambda: torch.linalg.solve(a, dev),
            "cholesky": lambda: torch.linalg.cholesky(a),
            "host index": lambda: dev[torch.tensor([0, 1])],
            "blocking copy": lambda: x.to("cuda"),
            "copy from unpinned memory": lambda: x.to("cuda", non_blocking=True),
        }
        for name, op in waits.items():
            before = fc.traffic.syncs
            op()
            assert fc.traffic.syncs == before + 1, name
        before = fc.traffic.counts()
        free = [
            lambda: dev @ dev,
            lambda: torch.linalg.cholesky_ex(a),
            lambda: torch.where(dev > 0, dev, 0.0),
            lambda: dev[torch.arange(2, device="cuda")],
            lambda: torch.repeat_interleave(torch.ones(3, dtype=torch.int64, device="cuda"), output_size=3),
            lambda: x.pin_memory().to("cuda", non_blocking=True),
        ]
        for op in free:
            op()
        syncs, launches, h2d, _ = fc.traffic.counts()
        assert syncs == before[0] and h2d == before[2] + 1 and launches >= before[1] + 5
        before = fc.traffic.launches
        dev.T.reshape(-1)[:3].unsqueeze(0)  # views and a copy of one: one kernel
        torch.empty(4, device="cuda")  # an allocation: none
        assert fc.traffic.launches == before + 1


def test_the_rank_revealing_fallback_solves_on_the_host_what_cuda_cannot():
    """The systems a Cholesky refused are near-singular; CUDA's lstsq (gels) assumes full rank, so the
    fallback of the ridge solves runs them on the host and returns the host's answer on the device."""
    a = torch.tensor([[[1.0, 2.0], [2.0, 4.0]]], dtype=torch.float64)  # rank 1
    b = torch.tensor([[[1.0], [2.0]]], dtype=torch.float64)
    expected = torch.linalg.lstsq(a, b).solution
    with fake_cuda():
        da, db = a.to("cuda"), b.to("cuda")
        with pytest.raises(RuntimeError, match="gels"):
            torch.linalg.lstsq(da, db, driver="gelsy")  # what the CPU default would ask of CUDA
        got = linalg.lstsq_rank_revealing(da, db)
        assert got.is_cuda
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-12, atol=1e-12)  # the minimum-norm (0.2, 0.4)
