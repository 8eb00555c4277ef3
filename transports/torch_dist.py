"""The torch.distributed backend: gloo on CPU, nccl on CUDA, xccl (or oneCCL's ccl) on XPU.

Buffers are torch tensors; split sizes count rows of dimension 0. The all-to-all moves raw
bytes (each row viewed as ``uint8``), which is exact for a permutation of rows and makes every
dtype work on every backend (bfloat16, bool and complex included).

torch orders a process group's members by global rank, whatever order ``new_group`` is given;
a :class:`~transports.base.Group` keeps the caller's order, so for a group whose ranks are not
ascending the send blocks and the received blocks are permuted around the collective (one
copy each way; ascending groups, the usual case, cost nothing extra).
"""

from __future__ import annotations

import atexit
import math
import re
from collections.abc import Callable, Sequence
from datetime import timedelta
from importlib.util import find_spec
from typing import Any

import torch
import torch.distributed as dist

from transports.base import Group, TransportError, check_all_to_all, check_group_ranks
from transports.launch import LaunchError, LaunchInfo, detect_launch, in_job, torch_store

# Device type -> collective backend. XPU falls back to oneCCL's "ccl" when torch lacks xccl.
BACKEND_FOR_DEVICE: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl"}
# The backends that move device memory themselves (no staging through the host): what
# ``--transport auto`` prefers over MPI.
DEVICE_BACKENDS = frozenset({"nccl", "xccl", "ccl"})
# Device type -> the variable that narrows which devices a process sees. Under it, index 0
# is a different device in every rank that was given a different mask.
MASK_VARIABLE: dict[str, str] = {"cuda": "CUDA_VISIBLE_DEVICES", "xpu": "ZE_AFFINITY_MASK"}
# Seconds a rank waits for a peer when the caller does not say. oneCCL's set-up over many
# nodes is slow: ALCF sets CCL_KVS_CONNECTION_TIMEOUT=600 for it (docs.alcf.anl.gov,
# aurora/data-science/frameworks/oneCCL), and its DDP examples give init_process_group 3600 s.
DEFAULT_TIMEOUT_S = 60.0
BACKEND_TIMEOUT_S: dict[str, float] = {"xccl": 600.0, "ccl": 600.0}


# gloo prefixes its errors with the C++ source location and ends some with advice:
# "[/.../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:17640: Connection reset by
# peer. This is typically caused by a remote worker hanging or bugs in ..."
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")
_ADVICE = " This is typically caused by"


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    text = _SOURCE_LOCATION.sub("", text).split(_ADVICE)[0]
    return text if len(text) <= 300 else text[:297] + "..."


def _waiting_for(rank: int, group: Group) -> str:
    """Which peers a failed collective was waiting for: one only in a group of two."""
    peers = [r for r in group.ranks if r != rank]
    if len(peers) == 1:
        return f"rank {peers[0]}"
    return f"one of ranks {', '.join(map(str, peers))}"


def default_device(local_rank: int) -> torch.device:
    """This rank's accelerator (CUDA, then XPU) chosen by local rank, else the CPU.

    Under a per-rank affinity mask (ALCF's ``gpu_tile_compact.sh``) a rank sees one device
    and takes index 0; in Aurora's FLAT mode (the ``frameworks`` module's default) it sees a
    node's 12 tiles and takes its local rank's.

    Raises:
        LaunchError: torch is an XPU build, no XPU is visible, and this process runs in a job
            (a launcher's or scheduler's variables): a wrong ``ZE_AFFINITY_MASK`` or
            ``ONEAPI_DEVICE_SELECTOR`` would otherwise put the whole run on the CPU.
    """
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return torch.device("xpu", local_rank % xpu.device_count())
    if getattr(torch.version, "xpu", None) and in_job():
        import os

        steering = " ".join(f"{name}={os.environ[name]}" for name in
                            ("ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR",
                             "ZE_FLAT_DEVICE_HIERARCHY") if name in os.environ) or "none set"
        raise LaunchError(f"torch {torch.__version__} is an XPU build but this rank sees no XPU "
                          f"(device variables: {steering}): refusing to fall back to the CPU; "
                          "check the affinity mask and device selector (and run on a compute "
                          "node)")
    return torch.device("cpu")


def device_identity(device: torch.device) -> str:
    """What ``device`` is, in words two ranks of one node can compare: the same words only
    when they hold the same device.

    The index alone is not enough: under a per-rank affinity mask every rank takes index 0.
    So: the mask's entry for the index where a mask is set (``ZE_AFFINITY_MASK=3.1``), else
    the index (FLAT mode: the node's device numbering); and the device's UUID wherever the
    runtime reports one (``get_device_properties(i).uuid``).
    """
    import os

    if device.type == "cpu":
        return "cpu"
    index = 0 if device.index is None else device.index
    mask_variable = MASK_VARIABLE.get(device.type)
    mask = os.environ.get(mask_variable, "") if mask_variable else ""
    entries = [entry.strip() for entry in mask.split(",") if entry.strip()]
    where = (f"{device.type} {mask_variable}[{index}]={entries[index]}" if index < len(entries)
             else f"{device.type}:{index}")
    uuid = _device_uuid(device.type, index)
    return f"{where} uuid {uuid}" if uuid else where


def _device_uuid(device_type: str, index: int) -> str | None:
    module = getattr(torch, device_type, None)
    if module is None:
        return None
    try:
        uuid = getattr(module.get_device_properties(index), "uuid", None)
    except (AttributeError, RuntimeError, AssertionError):
        return None  # a runtime that cannot describe its device: the mask/index decides
    return str(uuid) if uuid else None


def rank_device(transport: Any, local_rank: int) -> torch.device:
    """Where a rank computes: the device its transport took (torch: the accelerator its
    local rank selects), else that accelerator (MPI stages device tensors through host
    memory; a single process has no transport), else the CPU."""
    device = getattr(transport, "device", None)
    return torch.device(device) if device is not None else default_device(local_rank)


def ranks_per_device(launch: LaunchInfo, device: torch.device) -> int:
    """How many of this node's ranks take ``device`` (devices are dealt round-robin by local
    rank, :func:`default_device`); 1 when the launcher does not say how many ranks the node
    has. Under a per-rank mask this over-counts (each rank's index 0 is its own device):
    only CUDA acts on the count, and gloo there is slow but right, where nccl on a GPU
    that a node-wide ``CUDA_VISIBLE_DEVICES`` really shares would fail. ``cocodiff doctor``
    tells the two apart (:func:`device_identity`)."""
    if device.type == "cpu" or launch.local_size is None:
        return 1
    count = getattr(torch, device.type).device_count()
    index = device.index or 0
    return len(range(index, launch.local_size, max(1, count)))


def backend_for_device(device: torch.device, sharing: int = 1) -> str:
    """The torch.distributed backend for tensors on ``device``, taken by ``sharing`` ranks.

    NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); ranks sharing a CUDA
    device get gloo instead, which stages CUDA tensors through host memory.

    Raises:
        TransportError: no backend is known or installed for the device type.
    """
    if device.type not in BACKEND_FOR_DEVICE:
        known = ", ".join(sorted(BACKEND_FOR_DEVICE))
        raise TransportError(f"no torch.distributed backend for device {device} (known: {known})")
    if device.type == "cuda" and sharing > 1:
        return "gloo"
    backend = BACKEND_FOR_DEVICE[device.type]
    if backend == "xccl" and not getattr(dist, "is_xccl_available", lambda: False)():
        if find_spec("oneccl_bindings_for_pytorch") is None:
            raise TransportError(
                "XPU needs torch built with xccl or oneccl_bindings_for_pytorch installed"
            )
        backend = "ccl"
    return backend


def device_backend(launch: LaunchInfo) -> str | None:
    """The collective backend that would move this rank's device memory directly (nccl,
    xccl, oneCCL's ccl), or None: no accelerator, ranks sharing a GPU (gloo), or no such
    backend in this torch."""
    device = default_device(launch.local_rank)
    try:
        backend = backend_for_device(device, ranks_per_device(launch, device))
    except TransportError:
        return None
    return backend if backend in DEVICE_BACKENDS else None


class _TorchHandle:
    """One all-to-all in flight. ``wait()`` returns the received tensor once."""

    __slots__ = ("_work", "_send", "_output", "_finish", "_what", "_waited")

    def __init__(
        self,
        work: Any,
        send: torch.Tensor,
        output: torch.Tensor,
        finish: Callable[[torch.Tensor], torch.Tensor],
        what: str,
    ) -> None:
        self._work = work
        self._send: torch.Tensor | None = send  # kept alive until the collective is done
        self._output: torch.Tensor | None = output
        self._finish = finish
        self._what = what
        self._waited = False

    def is_completed(self) -> bool:
        return self._waited or bool(self._work.is_completed())

    def wait(self) -> torch.Tensor:
        """Block until this rank's part is done (on CUDA/XPU: until the current stream is
        ordered after it) and return the received rows, grouped by source."""
        if self._waited:
            raise TransportError("wait() called twice on the same handle")
        self._waited = True
        try:
            self._work.wait()
        except RuntimeError as exc:
            raise TransportError(f"{self._what}: {_one_line(exc)}") from exc
        output, self._output, self._send = self._output, None, None
        assert output is not None
        return self._finish(output)


class TorchTransport:
    """A :class:`~transports.base.Transport` over torch.distributed.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ``"xccl"``, ``"ccl"``...; None picks it from the
            device and how many of the node's ranks share it (:func:`backend_for_device`).
        device: where this rank's tensors live; None picks the local accelerator or the CPU.
        timeout_s: how long a rendezvous or a collective may wait for a peer before it fails
            with :class:`TransportError` instead of hanging; None: the backend's default
            (:data:`BACKEND_TIMEOUT_S`, else :data:`DEFAULT_TIMEOUT_S`).
        launch: this process's place in the job; None reads the launcher's environment.

    If the default process group already exists (the caller initialised torch.distributed),
    it is used and :meth:`close` leaves it alone, destroying only the groups made here.
    """

    def __init__(
        self,
        *,
        backend: str | None = None,
        device: str | torch.device | None = None,
        timeout_s: float | None = None,
        launch: LaunchInfo | None = None,
    ) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        info = detect_launch() if launch is None else launch
        self._device = default_device(info.local_rank) if device is None else torch.device(device)
        self._backend = (backend_for_device(self._device, ranks_per_device(info, self._device))
                         if backend is None else backend)
        if timeout_s is None:
            timeout_s = BACKEND_TIMEOUT_S.get(self._backend, DEFAULT_TIMEOUT_S)
        self._timeout = timedelta(seconds=timeout_s)
        if self._device.type != "cpu":
            getattr(torch, self._device.type).set_device(self._device)
        if self._backend == "ccl":
            import oneccl_bindings_for_pytorch  # noqa: F401  (registers the "ccl" backend)

        self._owns_default_group = not dist.is_initialized()
        if self._owns_default_group:
            self._init_default_group(info)
            # A process that exits with gloo work still pending (e.g. after a TransportError)
            # can abort in gloo's threads ("terminate called without an active exception");
            # tearing the groups down first avoids that.
            atexit.register(self.close)
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        self._world = Group(tuple(range(self._world_size)))
        self._groups: dict[tuple[int, ...], Group] = {self._world.ranks: self._world}
        self._process_groups: dict[tuple[int, ...], Any] = {}
        self._closed = False

    def _init_default_group(self, info: LaunchInfo) -> None:
        try:
            store = torch_store(info, self._timeout)
            # device_id binds the default group to this rank's device from the start (torch's
            # advice for device backends: nccl forms its communicator at once and splits
            # sub-groups from it). gloo, even over CUDA tensors of ranks sharing a GPU, gets
            # none.
            device_id = self._device if self._backend in DEVICE_BACKENDS else None
            dist.init_process_group(
                self._backend,
                store=store,
                rank=info.rank,
                world_size=info.world_size,
                timeout=self._timeout,
                device_id=device_id,
            )
        except LaunchError:
            raise  # a launch refused before the rendezvous: its own one line
        except (RuntimeError, ValueError) as exc:
            raise TransportError(
                f"torch.distributed ({self._backend}) init failed on rank {info.rank} of "
                f"{info.world_size} ({info.launcher}): {_one_line(exc)}"
            ) from exc

    @property
    def name(self) -> str:
        return "torch"

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def world(self) -> Group:
        return self._world

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed")

    def new_group(self, ranks: Sequence[int]) -> Group:
        """Create (or return the cached) sub-group. Collective over the whole world."""
        self._check_open()
        key = tuple(int(r) for r in ranks)
        if key in self._groups:
            return self._groups[key]
        check_group_ranks(key, self._world_size)
        members = tuple(sorted(key))
        if members not in self._process_groups:
            try:
                self._process_groups[members] = dist.new_group(
                    ranks=list(members), timeout=self._timeout
                )
            except RuntimeError as exc:
                raise TransportError(
                    f"torch new_group({list(key)}) failed: {_one_line(exc)}"
                ) from exc
        group = Group(key, handle=self._process_groups[members])
        self._groups[key] = group
        return group

    def all_to_all(
        self,
        send: torch.Tensor,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        group: Group | None = None,
    ) -> _TorchHandle:
        """Start an all-to-all of rows of ``send``; see :meth:`transports.base.Transport`."""
        self._check_open()
        group = self._world if group is None else group
        send_rows = [int(n) for n in send_splits]
        recv_rows = [int(n) for n in recv_splits]
        check_all_to_all(self._rank, group, send.shape, send_rows, recv_rows)
        trailing = tuple(send.shape[1:])
        # (n, *trailing) -> (n, row_bytes) uint8, a view of the contiguous send buffer.
        send_bytes = send.contiguous().reshape(send.shape[0], math.prod(trailing))
        send_bytes = send_bytes.view(torch.uint8)
        row_bytes = send_bytes.shape[1]
        # gloo takes host and CUDA tensors alike; nccl and xccl only their device's. A host
        # tensor (the control messages: node keys, argument digests) goes through the device
        # and comes back.
        home = send.device
        if self._backend != "gloo" and home != self._device:
            send_bytes = send_bytes.to(self._device)

        order = _ascending_order(group.ranks)
        if order is not None:  # torch's group order is ascending rank: permute around it
            send_bytes = torch.cat(_blocks(send_bytes, send_rows, order))
            send_rows = [send_rows[i] for i in order]
            recv_rows_torch = [recv_rows[i] for i in order]
        else:
            recv_rows_torch = recv_rows
        output = torch.empty(
            (sum(recv_rows), row_bytes), dtype=torch.uint8, device=send_bytes.device
        )

        def finish(received: torch.Tensor) -> torch.Tensor:
            if order is not None:
                # blocks arrive in ascending-rank order; put them back in group order
                inverse = sorted(range(len(order)), key=order.__getitem__)
                received = torch.cat(_blocks(received, recv_rows_torch, inverse))
            # (n, row_bytes) uint8 -> (n, *trailing) send.dtype
            return received.to(home).view(send.dtype).reshape(received.shape[0], *trailing)

        what = (f"torch/{self._backend} all_to_all on rank {self._rank} over group {group.ranks} "
                f"failed waiting for {_waiting_for(self._rank, group)}")
        try:
            work = dist.all_to_all_single(
                output,
                send_bytes,
                output_split_sizes=recv_rows_torch,
                input_split_sizes=send_rows,
                group=group.handle,
                async_op=True,
            )
        except RuntimeError as exc:
            raise TransportError(f"{what}: {_one_line(exc)}") from exc
        return _TorchHandle(work, send_bytes, output, finish, what)

    def barrier(self) -> None:
        self._check_open()
        try:
            dist.barrier()
        except RuntimeError as exc:
            raise TransportError(
                f"torch barrier failed on rank {self._rank}: {_one_line(exc)}"
            ) from exc

    def close(self) -> None:
        """Destroy the process groups made here (and the default one if made here).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owns_default_group:
            atexit.unregister(self.close)
            if dist.is_initialized():
                dist.destroy_process_group()
        else:
            for process_group in self._process_groups.values():
                dist.destroy_process_group(process_group)
        self._process_groups.clear()




def _ascending_order(ranks: tuple[int, ...]) -> list[int] | None:
    """Group indices in ascending-rank order, or None when the group is already ascending."""
    order = sorted(range(len(ranks)), key=ranks.__getitem__)
    return None if order == list(range(len(ranks))) else order


def _blocks(rows: torch.Tensor, splits: list[int], picks: Sequence[int]) -> list[torch.Tensor]:
    """The blocks of ``rows`` (split by ``splits``) at the indices ``picks``, in that order."""
    blocks = torch.split(rows, splits)
    return [blocks[i] for i in picks]
