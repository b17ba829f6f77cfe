"""A fake CUDA device: run fedpers' real ``--device cuda`` code on a CPU-only torch and fail where a GPU would.

No GPU has been lent to this project, and ``--kernels device --device cpu`` (how CI tests the device
code) cannot catch the errors a real GPU run hits first. Inside :func:`fake_cuda`:

* ``torch.cuda.is_available()`` is True: one device, named "fake"; ``synchronize``, seeding and the
  memory queries are harmless no-ops.
* A tensor put "on cuda" (a factory's ``device=``, ``.to``, ``.cuda()``, ``torch.tensor(..., device=)``)
  is a CPU tensor *tagged* as a device tensor: its ``.device`` is ``cuda:0``, ``is_cuda`` is True, so
  the code takes its ``device.type != "cpu"`` branches. Every aten op with a tagged input tags its
  outputs; ``.cpu()``, ``.to("cpu")`` and a factory's ``device="cpu"`` give untagged tensors.
* Every aten op is checked against CUDA's device rules (:func:`_check_devices`): an op mixing tagged
  and untagged tensors raises CUDA's "Expected all tensors to be on the same device" unless CUDA
  allows that mix (one 0-dim CPU input of an elementwise kernel; CPU index tensors in ``x[idx]``;
  a 0-dim value in ``x[idx] = v``, ``fill_``, ``masked_fill_``; a cross-device ``copy_``).
* ``torch.Generator(device="cuda")`` is a CPU generator tagged cuda; drawing with it into a host
  tensor, or with a host generator into a device tensor, raises CUDA's "Expected a 'cuda' device
  type for generator but found 'cpu'" (or the reverse).
* ``.numpy()`` (and so ``np.asarray``, scipy) of a tagged tensor raises CUDA's TypeError "can't
  convert cuda:0 device type tensor to numpy".
* Host→device and device→host copies are counted in :class:`Traffic` with the fedpers line that made
  them, and so is every point where the host waits for the device (a *sync*): a read (``item``,
  ``float``, ``bool``, ``tolist``, ``.cpu()``, any device→host copy), a blocking host→device copy
  (PyTorch's ``memcpy_and_sync``: anything but a ``non_blocking`` copy from pinned memory), and the
  device ops whose result size or error check the host must see (:data:`SYNCING`: ``nonzero``,
  a boolean-mask index, ``torch.equal``, ``unique``, LAPACK-style error checks, ...).
* Kernel launches: every op run on the device other than views and allocations (:data:`NO_KERNEL`),
  counted in :class:`Traffic` by op (a fused CUDA op may launch a few kernels, a decomposed one
  appears as its parts: an approximation of the launch count, exact in how it grows with the data).
* Thread-pool workers (``concurrent.futures``) run under the fake too: torch's modes are per thread.

What it cannot check:

* Values. Real CUDA draws Philox streams, which a fake cannot reproduce: under the fake a "cuda"
  generator draws the CPU generator's (Mersenne Twister) numbers, so a fake-cuda run of a seed is
  the ``--kernels device --device cpu`` run of it (up to float summation order where the code's GPU
  branches sum differently), not what a GPU would draw. Ops run on CPU kernels: no cuBLAS/cuSOLVER
  rounding, TF32 or atomics nondeterminism.
* Kernel coverage, beyond two modelled gaps (integer matrix products; ``lstsq`` drivers other than
  ``gels``, see :func:`_check_cuda_kernels`): an op or dtype that has no CUDA kernel passes here.
* Asynchrony: streams, a ``non_blocking`` copy read before a synchronize, and errors a GPU reports
  late (a device-side assert on an out-of-range index).
* Memory: there is none on the device, so no out-of-memory; the memory queries return fixed numbers.
  Devices other than ``cuda:0`` raise "invalid device ordinal".
* Other processes: Ray/Flower node actors and a sweep's worker processes run outside the fake; only
  ``concurrent.futures`` thread pools follow it (not a bare ``threading.Thread``).
* Rules are checked on aten ops, after torch's Python-level decompositions, where CUDA's kernels
  check them, and approximate them: a mix some non-elementwise CUDA kernel accepts without a rule
  here is reported as mixing (strict, loud), while an elementwise kernel built without CPU-scalar
  support (``nextafter``) would accept a 0-dim host input here (lax).
* Tags are attributes of the tensor objects: they outlive the context (harmless outside it) and
  survive pickling (a tensor saved under the fake and loaded with ``map_location="cpu"`` still
  claims cuda).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import types
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import fedpers

Tensor = torch.Tensor
aten = torch.ops.aten
CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
_TAG = "_fake_cuda"
_FEDPERS = os.path.dirname(os.path.abspath(fedpers.__file__)) + os.sep
_REAL_GENERATOR = torch.Generator
_REAL_SUBMIT = ThreadPoolExecutor.submit


def on_device(t: Tensor) -> bool:
    """Whether ``t`` is a (fake) device tensor."""
    return bool(getattr(t, _TAG, False))


def _mark(out: Any, device: bool, inputs: tuple[Tensor, ...] = ()) -> None:
    """Tag (or untag) the tensors of ``out`` other than ``inputs`` (an op returning its ``self`` keeps its side)."""
    for t in pytree.tree_leaves(out):
        if isinstance(t, Tensor) and not any(t is i for i in inputs):
            setattr(t, _TAG, device)


def _target(device: Any) -> torch.device:
    """The device a ``device=`` argument names (only cuda:0 exists, as on a one-GPU machine)."""
    if isinstance(device, int):
        device = torch.device("cuda", device)
    dev = device if isinstance(device, torch.device) else torch.device(device)
    if dev.type == "cuda" and dev.index not in (None, 0):
        raise RuntimeError("CUDA error: invalid device ordinal (fake_cuda has one device, cuda:0)")
    return dev


def _mixing(func: Any) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
        f"(fake_cuda: {func})"
    )


class FakeCudaGenerator(_REAL_GENERATOR):
    """``torch.Generator`` under the fake: ``device="cuda"`` makes a CPU generator tagged cuda
    (it draws the CPU's Mersenne-Twister stream, not CUDA's Philox)."""

    def __new__(cls, device: Any = "cpu") -> FakeCudaGenerator:
        dev = _target("cpu" if device is None else device)
        g = super().__new__(cls, "cpu" if dev.type == "cuda" else dev)
        g.fake_cuda = dev.type == "cuda"
        return g

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return CUDA if self.fake_cuda else super().device


def _generator_device(g: torch.Generator) -> str:
    return "cuda" if getattr(g, "fake_cuda", False) else g.device.type


@dataclass
class Traffic:
    """Copies between host and device, points where the host waits for the device (syncs), and kernel
    launches, with where fedpers made them."""

    h2d: int = 0
    d2h: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    syncs: int = 0
    launches: int = 0
    sites: Counter = field(default_factory=Counter)
    site_bytes: Counter = field(default_factory=Counter)
    ops: Counter = field(default_factory=Counter)
    """Launches by aten op name."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, t: Tensor | None = None, waits: bool = False) -> None:
        """One copy (``h2d``, ``d2h``) or sync (``sync``); ``waits``: a copy the host waits for (also a sync)."""
        size = 0 if t is None else t.numel() * t.element_size()
        site = _caller()
        with self.lock:
            if kind == "h2d":
                self.h2d += 1
                self.h2d_bytes += size
            elif kind == "d2h":
                self.d2h += 1
                self.d2h_bytes += size
            if kind == "sync" or waits:
                self.syncs += 1
            self.sites[(kind, site)] += 1
            self.site_bytes[(kind, site)] += size
            if kind != "sync" and waits:
                self.sites[("sync", site)] += 1

    def launch(self, func: Any) -> None:
        with self.lock:
            self.launches += 1
            self.ops[func.__name__] += 1

    def counts(self) -> tuple[int, int, int, int]:
        """(syncs, launches, h2d, d2h) so far: differences of two are what ran between them."""
        with self.lock:
            return self.syncs, self.launches, self.h2d, self.d2h

    def sync_sites(self) -> Counter:
        """Syncs by fedpers line."""
        with self.lock:
            return Counter({site: n for (kind, site), n in self.sites.items() if kind == "sync"})

    def reset(self) -> None:
        with self.lock:
            self.h2d = self.d2h = self.h2d_bytes = self.d2h_bytes = self.syncs = self.launches = 0
            self.sites.clear()
            self.site_bytes.clear()
            self.ops.clear()

    def report(self) -> str:
        """One line per (kind, fedpers line), most frequent first: count, bytes, kind, where."""
        return "\n".join(
            f"{n:6d} {self.site_bytes[(kind, site)]:>12,d} B  {kind:4s} {site}"
            for (kind, site), n in self.sites.most_common()
        )


def _caller() -> str:
    """The innermost fedpers source line on the stack (where a copy or sync was asked for)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_FEDPERS):
            return f"{name[len(_FEDPERS) - len('fedpers/') :]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "(outside fedpers)"


_LOCAL = threading.local()
"""``ambient``: the device of the torch call being run (factories inside it with no tensor input
take it: a C++ composite makes its helpers with its inputs' options)."""


def _ambient() -> bool:
    return getattr(_LOCAL, "ambient", False)


@contextlib.contextmanager
def _ambient_as(device: bool) -> Iterator[None]:
    old = _ambient()
    _LOCAL.ambient = device
    try:
        yield
    finally:
        _LOCAL.ambient = old


# ----- the Python-level layer: devices of tensors and generators, transfers, numpy -------------------
def _to_target(args: tuple, kwargs: dict) -> tuple[torch.device | None, dict]:
    """(target device or None, the other arguments) of ``Tensor.to(...)``."""
    rest = args[1:]
    if rest and isinstance(rest[0], Tensor):  # to(other, non_blocking, copy)
        other = rest[0]
        return (CUDA if on_device(other) else CPU), {"dtype": other.dtype, **kwargs}
    kwargs = dict(kwargs)
    copy = kwargs.pop("copy", None)
    if isinstance(rest[0] if rest else None, int) and not isinstance(rest[0], bool):
        rest = (torch.device("cuda", rest[0]), *rest[1:])
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*rest, **kwargs)
    keep = {"dtype": dtype, "non_blocking": non_blocking, "memory_format": memory_format, "copy": copy}
    return (None if device is None else _target(device)), {k: v for k, v in keep.items() if v is not None}


_PINNED = "_fake_pinned"


def _pinned(t: Tensor) -> bool:
    return bool(getattr(t, _PINNED, False))


def _move(traffic: Traffic, t: Tensor, device: bool, **kwargs: Any) -> Tensor:
    """``t`` on the (fake) device or the host: a copy when it changes sides, counted. The host waits
    for every copy to it, and for a copy to the device unless it is ``non_blocking`` from pinned
    memory (PyTorch's blocking copies end in a stream synchronisation: ``memcpy_and_sync``)."""
    if on_device(t) == device:
        out = Tensor.to(t, **kwargs)
    else:
        waits = not device or not (kwargs.get("non_blocking") and _pinned(t))
        traffic.add("h2d" if device else "d2h", t, waits=waits)
        out = Tensor.to(t, **{**kwargs, "copy": True})
    _mark(out, device)
    return out


def _generator_check(func: Any, args: tuple, kwargs: dict, device: torch.device | None) -> None:
    """A generator draws only on its own device type (CUDA: ``check_generator`` in ATen/core/Generator.h)."""
    g = kwargs.get("generator")
    if not isinstance(g, torch.Generator):
        g = next((a for a in args if isinstance(a, torch.Generator)), None)
    if g is None:
        return
    if device is not None:
        draw = device.type
    elif isinstance(kwargs.get("out"), Tensor):
        draw = "cuda" if on_device(kwargs["out"]) else "cpu"
    else:
        first = next((t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)), None)
        draw = "cuda" if first is not None and on_device(first) else "cpu"
    if draw != _generator_device(g):
        raise RuntimeError(
            f"Expected a '{draw}' device type for generator but found '{_generator_device(g)}' (fake_cuda: {func})"
        )


_NEW = {Tensor.new_tensor, Tensor.new_empty, Tensor.new_zeros, Tensor.new_ones, Tensor.new_full}
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}


class _Functions(TorchFunctionMode):
    """Devices as the code sees them (``.device``, ``is_cuda``), the ``device=`` of factories and
    ``.to``/``.cuda``/``.cpu`` (tagging instead of moving), generators' devices, and ``.numpy()``."""

    def __init__(self, traffic: Traffic) -> None:
        super().__init__()
        self.traffic = traffic
        self.special: dict[Any, Callable[..., Any]] = {
            Tensor.device.__get__: lambda t: CUDA if on_device(t) else Tensor.device.__get__(t),
            Tensor.is_cuda.__get__: lambda t: on_device(t),
            Tensor.is_cpu.__get__: lambda t: not on_device(t) and Tensor.is_cpu.__get__(t),
            Tensor.get_device: lambda t: 0 if on_device(t) else Tensor.get_device(t),
            Tensor.numpy: self._numpy(Tensor.numpy),
            Tensor.__array__: self._numpy(Tensor.__array__),
            Tensor.tolist: self._tolist,
            Tensor.cpu: lambda t, *a, **k: _move(self.traffic, t, False, **k),
            Tensor.cuda: self._cuda,
            Tensor.to: self._to,
            Tensor.pin_memory: lambda t, *a, **k: self._pin(t),
            Tensor.is_pinned: lambda t, *a, **k: _pinned(t),
            torch.nn.functional.one_hot: self._one_hot,
        }

    def _numpy(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def numpy(t: Tensor, *args: Any, force: bool = False, **kwargs: Any) -> Any:
            if on_device(t) and force and real is Tensor.numpy:  # numpy(force=True) copies to the host
                self.traffic.add("d2h", t, waits=True)
            elif on_device(t):  # torch/csrc/utils/tensor_numpy.cpp
                raise TypeError(
                    "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory first."
                )
            return real(t, *args, force=force, **kwargs) if real is Tensor.numpy else real(t, *args, **kwargs)

        return numpy

    def _tolist(self, t: Tensor) -> Any:
        if on_device(t):
            self.traffic.add("d2h", t, waits=True)
        return Tensor.tolist(t)

    def _cuda(self, t: Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> Tensor:
        _target(CUDA if device is None else device)
        return _move(self.traffic, t, True, non_blocking=non_blocking, **kwargs)

    def _to(self, t: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        device, rest = _to_target((t, *args), kwargs)
        if device is None:
            return Tensor.to(t, **rest)
        return _move(self.traffic, t, device.type == "cuda", **rest)

    @staticmethod
    def _one_hot(t: Tensor, num_classes: int = -1) -> Tensor:
        """CUDA's ``one_hot`` with ``num_classes`` given reads nothing on the host (a bad class is a device
        assert of its scatter); the CPU kernel's range checks (``min().item()``) would count as syncs."""
        if not on_device(t) or num_classes < 0:
            return torch.nn.functional.one_hot(t, num_classes)
        out = t.new_zeros(*t.shape, num_classes, dtype=torch.int64)  # (the ops inside a handler bypass this mode)
        return out.scatter_(-1, t.unsqueeze(-1), 1)

    @staticmethod
    def _pin(t: Tensor) -> Tensor:
        """A pinned copy of a host tensor (tagged: a ``non_blocking`` copy of it to the device does not wait)."""
        if on_device(t):
            raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned")
        out = t.clone()
        setattr(out, _PINNED, True)
        return out

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        special = self.special.get(func)
        if special is not None:
            return special(*args, **kwargs)
        device = _target(kwargs["device"]) if kwargs.get("device") is not None else None
        _generator_check(func, args, kwargs, device)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        if device is None and func in _NEW:
            device = CUDA if on_device(args[0]) else CPU
        if device is not None:
            kwargs["device"] = CPU
            on = device.type == "cuda"
            if func in _FROM_DATA and args:
                data = [t for t in pytree.tree_leaves(args[0]) if isinstance(t, Tensor)]
                if on and not (data and all(on_device(t) for t in data)):
                    self.traffic.add("h2d", data[0] if data else None, waits=True)
                elif not on and any(on_device(t) for t in data):
                    self.traffic.add("d2h", data[0], waits=True)
        else:
            on = any(on_device(t) for t in tensors)
        with _ambient_as(on):
            out = func(*args, **kwargs)
        if device is not None:
            if any(out is t and on_device(t) != on for t in tensors):  # e.g. as_tensor(x, device=...) returned x
                out = out.clone()
            _mark(out, on)
        return out


# ----- the aten layer: CUDA's device rules on every op, tags carried to the outputs -----------------
_INDEX = {aten.index.Tensor, aten._unsafe_index.Tensor}
_INDEX_PUT = {aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_INDEX_PUT |= {aten._unsafe_index_put.default}
_SCALAR_VALUE = {aten.fill_.Tensor: 1, aten.fill.Tensor: 1, aten.masked_fill_.Tensor: 2, aten.masked_fill.Tensor: 2}
"""Ops taking a 0-dim ``value`` tensor from either device (read with ``item()``): ``fill_`` in
aten/src/ATen/native/Fill.cpp, ``masked_fill__cuda`` in aten/src/ATen/native/cuda/Indexing.cu."""


def _written(func: Any, args: tuple, kwargs: dict) -> set[int]:
    """ids of the tensors ``func`` writes (in-place ``self``, ``out=``): outputs get no CPU-scalar exemption."""
    out = set()
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        out |= {id(t) for t in pytree.tree_leaves(value) if isinstance(t, Tensor)}
    return out


def _check_devices(func: Any, args: tuple, kwargs: dict, tensors: list[Tensor], traffic: Traffic) -> bool:
    """Raise what CUDA raises for an op whose tensors are on both sides; if CUDA allows the mix,
    return whether the op runs on the device (where its new outputs are).

    * Elementwise kernels (aten ops tagged ``pointwise``: TensorIterator with ``allow_cpu_scalars``)
      take at most one 0-dim CPU tensor as an input beside device tensors, never as an output:
      ``TensorIteratorBase::compute_types`` in aten/src/ATen/TensorIterator.cpp ("Expected all tensors
      to be on the same device, but found at least two devices", "Trying to pass too many CPU scalars
      to non-CPU kernel!"); torch's FakeTensor applies the same 0-dim rule (torch/_subclasses/fake_tensor.py,
      ``_find_common_device``).
    * ``x[idx]``: index tensors on the CPU or on x's device, so a device index of a host tensor
      raises (``check_indices_on_cpu_or_selfdevice`` in aten/src/ATen/native/TensorAdvancedIndexing.cpp,
      pytorch#69607); ``x[idx] = v`` (``_index_put_impl_``, same file) also moves a 0-dim ``v``
      only, any other ``v`` must be on x's device. CPU indices of a device tensor are copied to it (counted).
    * ``fill_``/``masked_fill_`` with a 0-dim value tensor: the value from either device (:data:`_SCALAR_VALUE`).
    * Every other op (codegen's ``check_and_update_common_device``): all tensors on one device.
    """
    if func in _INDEX or func in _INDEX_PUT:
        self, indices = args[0], [t for t in args[1] if isinstance(t, Tensor)]
        if not on_device(self) and any(on_device(t) for t in indices):
            raise RuntimeError(
                f"indices should be either on cpu or on the same device as the indexed tensor (cpu) (fake_cuda: {func})"
            )
        if on_device(self):
            for t in indices:
                if not on_device(t):
                    traffic.add("h2d", t, waits=True)
        if func in _INDEX_PUT and on_device(args[2]) != on_device(self):
            if args[2].dim() != 0:
                raise _mixing(func)
            # a 0-dim host value is mostly a Python scalar (``x[i] = 1.0``), which CUDA's indexing makes on
            # the device with a fill kernel (no copy, no wait): counted as a copy, a wait only to the host
            traffic.add("h2d" if on_device(self) else "d2h", args[2], waits=not on_device(self))
        return on_device(self)
    written = _written(func, args, kwargs)
    host = [t for t in tensors if not on_device(t)]
    if func in _SCALAR_VALUE:
        value = args[_SCALAR_VALUE[func]]
        rest = {on_device(t) for t in tensors if t is not value}
        if isinstance(value, Tensor) and value.dim() == 0 and len(rest) == 1:
            if on_device(value):
                traffic.add("sync")
            return rest.pop()
    if torch.Tag.pointwise in func.tags:
        scalars = [t for t in host if t.dim() == 0 and id(t) not in written]
        if len(scalars) == len(host):
            if len(scalars) > 1:
                raise RuntimeError(f"Trying to pass too many CPU scalars to non-CPU kernel! (fake_cuda: {func})")
            return True
    raise _mixing(func)


_GEMM = {
    aten.mm.default: "addmm",
    aten.addmm.default: "addmm",
    aten.addmm_.default: "addmm",
    aten.bmm.default: "bmm",
    aten.baddbmm.default: "baddbmm",
    aten.baddbmm_.default: "baddbmm",
    aten.addbmm.default: "addbmm",
    aten.mv.default: "addmv",
    aten.addmv.default: "addmv",
    aten.dot.default: "dot",
}
_TYPE_NAMES = {torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte"}
_TYPE_NAMES[torch.bool] = "Bool"


def _check_cuda_kernels(func: Any, args: tuple, kwargs: dict) -> dict:
    """Refuse what CUDA's kernels lack though the CPU's have it; return the arguments to run the CPU op with.

    * Integer and bool matrix products: cuBLAS has none (``"addmm_cuda" not implemented for 'Long'``).
    * ``torch.linalg.lstsq``: CUDA has only the ``gels`` driver (QR, full rank assumed; docs of
      ``torch.linalg.lstsq``), so a device lstsq runs CPU's ``gels`` here, not the CPU default ``gelsy``.
    """
    if func in _GEMM:
        dtype = next(t.dtype for t in args if isinstance(t, Tensor))
        if not (dtype.is_floating_point or dtype.is_complex):
            raise RuntimeError(
                f"\"{_GEMM[func]}_cuda\" not implemented for '{_TYPE_NAMES.get(dtype, dtype)}' (fake_cuda)"
            )
    if func is aten.linalg_lstsq.default:
        if kwargs.get("driver") not in (None, "gels"):
            raise RuntimeError("torch.linalg.lstsq: `driver` other than `gels` is not supported on CUDA (fake_cuda)")
        return {**kwargs, "driver": "gels"}
    return kwargs


SYNCING = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.bincount.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default,
    aten._linalg_check_errors.default,
    aten._linalg_eigh.default,
    aten._linalg_svd.default,
    aten.linalg_lstsq.default,
    aten.linalg_eig.default,
}
"""Device ops after which the host waits: an output whose size depends on the values (``nonzero`` and
what uses it), a bool the host gets (``equal``), or a LAPACK-style ``info`` check that CUDA reads on the
host (``_linalg_check_errors``: what ``solve``, ``cholesky``, ``inv`` without ``_ex`` call; ``eigh``,
``svd``, ``lstsq`` check inside their kernels). ``repeat_interleave`` without ``output_size``, an index
by a boolean mask and ``histc`` without a range are checked by :func:`_syncs_on_device`."""

NO_KERNEL = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten._local_scalar_dense.default,
    aten._unsafe_view.default,
    aten.resize_.default,
    aten.set_.source_Storage_storage_offset,
    aten.set_.source_Tensor,
}
"""Ops run on the device that launch no kernel (allocations, reads) besides the views."""


def _syncs_on_device(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a device op makes the host wait (:data:`SYNCING`, and the cases decided by arguments)."""
    if func in SYNCING:
        return True
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func is aten.histc.default:
        lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
        hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
        return lo == hi
    if func in _INDEX or func in _INDEX_PUT:  # a boolean mask becomes indices through nonzero
        return any(isinstance(t, Tensor) and t.dtype in (torch.bool, torch.uint8) for t in args[1] if t is not None)
    return False


class _Aten(TorchDispatchMode):
    """Checks every aten op's devices, counts cross-device copies, and tags what a device op makes."""

    def __init__(self, traffic: Traffic) -> None:
        super().__init__()
        self.traffic = traffic

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is aten.copy_.default:  # a copy across devices is allowed (and counted)
            dst, src = args[0], args[1]
            if on_device(dst) != on_device(src):
                non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
                waits = not on_device(dst) or not (non_blocking and _pinned(src))
                self.traffic.add("h2d" if on_device(dst) else "d2h", src, waits=waits)
            elif on_device(dst):
                self.traffic.launch(func)
            return func(*args, **kwargs)
        if func is aten._to_copy.default and kwargs.get("device") is not None:
            # the Python layer moved what the code moved; a C++ ``to`` passes the real (host) device here
            on = on_device(args[0]) or _target(kwargs["device"]).type == "cuda"
            if on and not on_device(args[0]):
                self.traffic.add("h2d", args[0], waits=not (kwargs.get("non_blocking") and _pinned(args[0])))
            elif on:
                self.traffic.launch(func)
            out = func(*args, **{**kwargs, "device": CPU})
            _mark(out, on)
            return out
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        tagged = [t for t in tensors if on_device(t)]
        device = (
            bool(tagged)
            if len(tagged) in (0, len(tensors))
            else _check_devices(func, args, kwargs, tensors, self.traffic)
        )
        if tagged:
            kwargs = _check_cuda_kernels(func, args, kwargs)
        on = device or (not tensors and _ambient())
        if func is aten._local_scalar_dense.default and tagged:  # item(), float(), bool(): the host waits
            self.traffic.add("sync")
        elif on and _syncs_on_device(func, args, kwargs):
            self.traffic.add("sync")
        if on and not func.is_view and func not in NO_KERNEL:
            self.traffic.launch(func)
        out = func(*args, **kwargs)
        if on:
            _mark(out, True, tuple(tensors))
        return out


# ----- the context ---------------------------------------------------------------------------------------
@dataclass
class FakeCuda:
    """What :func:`fake_cuda` yields: the copy and sync counts so far."""

    traffic: Traffic


@contextlib.contextmanager
def _modes(traffic: Traffic) -> Iterator[None]:
    with _Aten(traffic), _Functions(traffic):
        yield


def _properties() -> Any:
    return types.SimpleNamespace(
        name="fake", total_memory=80 << 30, major=9, minor=0, multi_processor_count=132, is_integrated=False
    )


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeCuda]:
    """Run the body as if one CUDA device were present (see the module docstring)."""
    traffic = Traffic()

    def submit(pool: ThreadPoolExecutor, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            with _modes(traffic):
                return fn(*a, **k)

        return _REAL_SUBMIT(pool, run, *args, **kwargs)

    cuda = torch.cuda
    patches = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "_lazy_init": lambda: None,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: _target(device),
        "get_device_name": lambda device=None: "fake",
        "get_device_properties": lambda device=None: _properties(),
        "get_device_capability": lambda device=None: (9, 0),
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
        "mem_get_info": lambda device=None: (80 << 30, 80 << 30),
    }
    with contextlib.ExitStack() as stack:
        for name, value in patches.items():
            stack.enter_context(mock.patch.object(cuda, name, value))
        stack.enter_context(mock.patch.object(torch, "Generator", FakeCudaGenerator))
        stack.enter_context(mock.patch.object(ThreadPoolExecutor, "submit", submit))
        stack.enter_context(_modes(traffic))
        yield FakeCuda(traffic)


def per_round(name: str, values: Mapping[str, Any], chunk: int) -> list[tuple[int, int, int]]:
    """(host syncs, kernel launches, chunks made) of every round of a ``--device cuda`` run of algorithm
    ``name`` (``values``: its config fields) on the local runtime under the fake device: gather,
    verification, release, server step. What tests/test_deferred_checks.py bounds and
    benchmarks/device_syncs.py prints (which loads this file beside another tree's fedpers)."""
    from fedpers import config
    from fedpers.experiments import EXPERIMENTS
    from fedpers.privacy import Privatizer
    from fedpers.runtime.local import run_local

    with fake_cuda() as fc:
        exp = EXPERIMENTS[name]
        cfg = config.build(exp.config_type, {**values, "device": "cuda"})
        source = exp.unit_source(cfg)
        made = [0]
        needed = source.needed_chunks

        def counted(*args: Any) -> Any:
            for part in needed(*args):
                made[0] += 1
                yield part

        source.needed_chunks = counted  # type: ignore[method-assign]
        marks: list[tuple[int, int, int]] = []
        fc.traffic.reset()

        def on_round(record: Any, state: Any) -> None:
            syncs, launches, _, _ = fc.traffic.counts()
            marks.append((syncs, launches, made[0]))

        run_local(exp.protocol(cfg), source, Privatizer(3), chunk_size=chunk, progress=False, on_round=on_round)
    out, last = [], (0, 0, 0)
    for mark in marks:
        out.append((mark[0] - last[0], mark[1] - last[1], mark[2] - last[2]))
        last = mark
    return out
