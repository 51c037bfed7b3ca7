"""The threaded process group, wrapped: the only module of ours that imports ``torch.testing``.

Upstream's ``multi_threaded_pg`` keeps its in-flight collectives and its termination flag in
class attributes shared by every group in the process, wakes released ranks with
``SystemExit``, and can tell a rank that its collective was aborted after the collective
already completed (the "done" flag is read after the termination flag). distconf keeps one
``Domain`` per World generation instead, so an abandoned generation (a rank stuck forever)
can never touch the collectives of its successor, and a released rank raises
``CollectiveAborted`` only when its collective really did not complete.

We reuse upstream's data movement (the ``work`` classes), its ``ProcessGroup`` subclass and
its thread-local c10d world; the rendezvous is ours. The backend keeps the name ``threaded``
because ``DeviceMesh`` keys meshes by thread only for that backend name.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions, ReduceScatterOptions
from torch.testing._internal.distributed import multi_threaded_pg as _upstream

from harness.errors import CollectiveMismatch, RunnerUnsupported
from harness.runners import _ddp_active
from harness.runners.capacity import THREADED_BACKEND
from harness.torchkit import tensor_meta

BACKEND = THREADED_BACKEND

# Operations this process group cannot serve, named as World.lacks names them.
UNSUPPORTED = frozenset(
    {
        "send",
        "recv",
        "reduce",
        "monitored_barrier",
        "reduce_scatter.premul_sum",
        # a Python ProcessGroup with no backend per device: _get_backend(device) raises
        "process_group.allocate_tensor",
    }
)

_install_lock = threading.Lock()
_users = 0
_installed = False
_registered = False
_bound = threading.local()
# Every rank thread that bound a Domain: c10d's world stays thread-local while one lives.
_rank_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


class CollectiveAborted(BaseException):
    """Raised in a rank waiting in a collective that will never complete.

    A ``BaseException`` so that a check's ``except Exception`` cannot swallow the release.
    """


class _Rendezvous:
    __slots__ = ("arrived", "calls", "cond", "data", "done", "error", "size", "work")

    def __init__(self, size: int, work: Any, lock: threading.Lock) -> None:
        self.size, self.work = size, work
        self.calls: list[str] = [""] * size
        # One condition per collective, sharing the domain's lock: completing a collective
        # wakes its own participants only, not every rank waiting on another mesh axis.
        self.cond = threading.Condition(lock)
        self.data: list[Any] = [None] * size
        self.arrived = 0
        self.done = False
        self.error: BaseException | None = None


class _ReduceScatter:
    """Reduce-scatter with the reduce ops upstream's all-reduce knows and its reduce-scatter
    lacks (MAX, MIN, PRODUCT, ...), which would leave Partial(max|min) -> Shard unchecked on
    threads."""

    def __init__(self, op: Any) -> None:
        kind = getattr(op, "op", op)
        if kind not in _upstream._reduce_ops:
            raise RunnerUnsupported(
                f"reduce_scatter with {_op_name(op)} is unsupported on the thread runner"
            )
        self.reduce = _upstream._reduce_ops[kind]

    @torch.no_grad()
    def work(self, data: list[Any]) -> None:
        for destination, (outputs, _) in enumerate(data):
            (output,) = outputs
            pieces = [scatter_lists[0][destination] for _, scatter_lists in data]
            # See upstream's Note [Hide collectives mutation from autograd].
            output.detach().copy_(self.reduce([p.to(output.device) for p in pieces]))


def settle(data: Any) -> None:
    """Wait for every stream of the device ``data`` lives on, where it is an accelerator.

    Rank threads share one device but each issues work on its own streams (FSDP's
    all-gather and reduce-scatter streams among them), and this group moves data between
    threads in Python: without a device-wide sync a collective reads inputs another
    thread's stream has not written yet, and a rank reads outputs before they are written.
    """
    devices = {t.device for t in _flat(data) if t.device.type not in ("cpu", "meta")}
    for device in devices:
        torch.get_device_module(device).synchronize(device)


class Domain:
    """The collectives of one World generation: rendezvous, abort flag, who waits where."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.lock = threading.Lock()
        self.inflight: dict[str, _Rendezvous] = {}
        self.waiting_in: dict[int, str] = {}
        self.aborted = False
        self.abort_reason = ""

    def abort(self, reason: str) -> None:
        with self.lock:
            if not self.aborted:
                self.aborted, self.abort_reason = True, reason
            for rv in self.inflight.values():
                rv.cond.notify_all()

    def poll_until(
        self, rank: int, where: str, ready: Callable[[], bool], timeout: timedelta
    ) -> None:
        """Wait for ``ready()`` outside the lock (it may call a store), as ``where``;
        ``CollectiveAborted`` as soon as the domain aborts."""
        deadline = time.monotonic() + timeout.total_seconds()
        delay = 0.0002
        with self.lock:
            self.waiting_in[rank] = where
        try:
            while not ready():
                if self.aborted:
                    raise CollectiveAborted(f"released from {where}: {self.abort_reason}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{where} timed out after {timeout}")
                time.sleep(delay)
                delay = min(2 * delay, 0.01)
        finally:
            with self.lock:
                self.waiting_in.pop(rank, None)

    def where(self, rank: int) -> str | None:
        with self.lock:
            return self.waiting_in.get(rank)

    def join(self, pg: DistconfThreadedGroup, call: str, work: Any, data: Any) -> Any:
        """Wait until every member of ``pg`` joined, then move the data once for all.

        ``call`` describes what this rank issued (op, shapes, dtypes, reduce op, root); the
        threaded group would otherwise let ranks that issued different collectives "succeed".
        """
        key, group_rank, rank = pg.pg_name, pg.group_rank, pg.global_rank
        name = call.split("(", 1)[0]
        settle(data)
        with self.lock:
            if self.aborted:
                raise CollectiveAborted(f"{name} on group {key} not started: {self.abort_reason}")
            rv = self.inflight.get(key)
            if rv is None:
                rv = self.inflight[key] = _Rendezvous(pg.size(), work, self.lock)
            rv.data[group_rank], rv.calls[group_rank] = data, call
            rv.arrived += 1
            if rv.arrived == rv.size:
                del self.inflight[key]
                self._complete(rv, key, pg)
            else:
                self.waiting_in[rank] = f"{name} on group {key}"
                rv.cond.wait_for(lambda: rv.done or self.aborted)
                self.waiting_in.pop(rank, None)
                if not rv.done:
                    raise CollectiveAborted(
                        f"released from {name} on group {key}: {self.abort_reason}"
                    )
            if isinstance(rv.error, CollectiveMismatch):
                raise CollectiveMismatch(str(rv.error))
            if rv.error is not None:
                raise RuntimeError(f"{name} on group {key} failed: {rv.error!r}") from rv.error
        return _upstream.ret_work(data)

    def _complete(self, rv: _Rendezvous, key: str, pg: DistconfThreadedGroup) -> None:
        if any(call != rv.calls[0] for call in rv.calls):
            rv.error = CollectiveMismatch(_describe_mismatch(rv.calls, key, pg.global_ranks))
        else:
            try:
                rv.work.work(rv.data)
                settle(rv.data)
            except Exception as exc:  # every participant reports the collective's own failure
                rv.error = exc
        rv.done = True
        rv.cond.notify_all()


class DistconfThreadedGroup(_upstream.ProcessLocalGroup):  # type: ignore[misc]  # untyped upstream
    """Upstream's threaded group with collectives routed through this generation's Domain."""

    def __init__(self, rank: int, world_size: int, domain: Domain) -> None:
        super().__init__(rank, world_size)
        self.group_rank = rank
        self.global_rank = dist.get_rank() if dist.is_initialized() else rank
        self.domain = domain

    @property
    def global_ranks(self) -> list[int]:
        """Global rank of each group rank (the default group maps ranks to themselves)."""
        if not dist.is_initialized():
            return list(range(self.size()))
        return list(dist.get_process_group_ranks(self))

    def _join(self, call: str, work: Any, data: Any) -> Any:
        return self.domain.join(self, call, work, data)

    def allreduce(self, tensor_list: Any, opts: Any = None) -> Any:
        op = (opts if opts is not None else AllreduceOptions()).reduceOp
        call = f"allreduce({_tensors(tensor_list)}, {_op_name(op)})"
        return self._join(call, _upstream.AllReduce(op), tensor_list)

    def allreduce_coalesced(self, tensor_list: Any, opts: Any = None) -> Any:
        return self.allreduce(tensor_list, opts)

    def allgather(self, output_tensors: Any, input_tensor: Any, opts: Any = None) -> Any:
        call = f"allgather({_tensors(input_tensor)})"
        return self._join(call, _upstream.AllGather(), (output_tensors, input_tensor))

    def broadcast(self, tensor_list: Any, opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        call = f"broadcast({_tensors(tensor_list)}, root={root})"
        return self._join(call, _upstream.Broadcast(root), tensor_list)

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        call = f"scatter({_tensors(output_tensors)}, root={root})"
        return self._join(call, _upstream.Scatter(root), (output_tensors, input_tensors))

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        call = f"gather({_tensors(input_tensors)}, root={root})"
        return self._join(call, _upstream.Gather(root), (output_tensors, input_tensors))

    def reduce_scatter(self, output_tensor: Any, scatter_list: Any, opts: Any = None) -> Any:
        op = (opts if opts is not None else ReduceScatterOptions()).reduceOp
        call = f"reduce_scatter({_tensors(output_tensor)}, {_op_name(op)})"
        # Upstream's own work for the ops it implements keeps its numerics (a running sum,
        # then a division for AVG); ours adds the ops it lacks.
        upstream = _op_name(op) in ("SUM", "AVG")
        work = _upstream.ReduceScatter(op) if upstream else _ReduceScatter(op)
        return self._join(call, work, (output_tensor, scatter_list))

    def alltoall(self, output_tensor_list: Any, input_tensor_list: Any, opts: Any = None) -> Any:
        # Split sizes may differ between ranks; only the dtype must agree.
        call = f"alltoall({_dtypes(input_tensor_list)})"
        return self._join(call, _upstream.AllToAll(), (output_tensor_list, input_tensor_list))

    def all_to_all_single(
        self,
        output_buffer: torch.Tensor,
        input_buffer: torch.Tensor,
        output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None,
        opts: Any = None,
    ) -> Any:
        data = (output_buffer, input_buffer, output_split_sizes, input_split_sizes)
        call = f"all_to_all_single({_dtypes([input_buffer])})"
        return self._join(call, _upstream.AllToAllBase(), data)

    def _unsupported(self, name: str) -> RunnerUnsupported:
        return RunnerUnsupported(
            f"{name} is unsupported on the thread runner (the threaded process group does "
            "not implement it); run this check on the process runner"
        )

    def send(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported("send")

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported("recv")

    def recv_anysource(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported("recv_anysource")

    def reduce(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported("reduce")

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported("monitored_barrier")


def _describe_mismatch(calls: list[str], key: str, global_ranks: list[int]) -> str:
    sides: dict[str, list[int]] = {}
    for group_rank, call in enumerate(calls):
        sides.setdefault(call, []).append(global_ranks[group_rank])
    described = "; ".join(f"ranks {ranks} called {call}" for call, ranks in sides.items())
    return f"mismatched collectives on group {key}: {described}"


def _flat(tensors: Any) -> list[torch.Tensor]:
    return [t for t in _upstream.flatten_list(tensors) if isinstance(t, torch.Tensor)]


def _tensors(tensors: Any) -> str:
    """What must agree across ranks of most collectives: each tensor's dtype and shape."""
    return ", ".join(
        f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in _flat(tensors)
    )


def _dtypes(tensors: Any) -> str:
    return ", ".join(sorted({str(t.dtype).removeprefix("torch.") for t in _flat(tensors)}))


def _op_name(op: Any) -> str:
    kind = getattr(op, "op", op)  # a ReduceOp wraps its RedOpType in .op
    return str(getattr(kind, "name", kind))


def _create_group(
    prefix_store: Any, rank: int, world_size: int, timeout: timedelta
) -> DistconfThreadedGroup:
    domain: Domain | None = getattr(_bound, "domain", None)
    if domain is None:
        raise RuntimeError(
            "the 'threaded' backend is served by distconf's thread runner: create groups "
            "from a rank thread of a harness World"
        )
    pg = DistconfThreadedGroup(rank, world_size, domain)
    # Groups of a 2-D mesh are created by different threads at once: wait until every member
    # has created this group before any of them uses it (as upstream does), but give way
    # when the World aborts: upstream's store barrier would hold a released rank for minutes.
    key = "distconf/created"
    prefix_store.add(key, 1)
    domain.poll_until(
        pg.global_rank,
        f"creating a process group of {world_size} ranks",
        lambda: int(prefix_store.add(key, 0)) >= world_size,
        timeout,
    )
    return pg


def install() -> None:
    """Make c10d's world thread-local, share DTensor's fake shape propagation between threads
    (``torchkit.tensor_meta``) and register our backend, for one more user (a thread World)
    until it calls ``release``."""
    global _users, _installed, _registered
    with _install_lock:
        _users += 1
        if not _installed:
            # Also turns autograd's multithreading off, process-wide, until uninstalled.
            _upstream._install_threaded_pg()
            _give_world_comms(_upstream.ThreadLocalWorld)
            torch._C._distributed_c10d._set_thread_isolation_mode(True)  # type: ignore[attr-defined]
            _ddp_active.install()
            # Every rank thread would run the same fake op to learn an output's global shape.
            tensor_meta.install()
            _installed = True
        if not _registered:
            dist.Backend.register_backend(BACKEND, _create_group, devices=["cpu", "cuda"])
            _registered = True


def _give_world_comms(world_class: type) -> None:
    """torch 2.11's ``destroy_process_group`` walks ``_world.comms``, which its thread-local
    world lacks (upstream added it later): every rank thread's exit raised AttributeError."""
    if hasattr(world_class, "comms"):
        return

    def comms(self: Any) -> list[Any]:
        local = world_class._world  # type: ignore[attr-defined]
        if not hasattr(local, "comms"):
            local.comms = []
        return local.comms  # type: ignore[no-any-return]

    world_class.comms = property(comms)  # type: ignore[attr-defined]


def release(grace: float = 0.0) -> None:
    """One user fewer. The last gives the process back c10d's shared world, its process
    group registry, autograd's multithreading and torch's own fake shape propagation once
    every rank thread has ended, waiting up to ``grace`` seconds for ranks still unwinding
    (one left stuck in C code would find its world gone when it returns, so then everything
    stays). The backend stays registered: it refuses to serve outside a rank thread."""
    global _users
    with _install_lock:
        assert _users > 0, "release() without install()"
        _users -= 1
        if _users or not _installed:
            return
        alive = [thread for thread in _rank_threads if thread.is_alive()]
    deadline = time.monotonic() + grace
    for thread in alive:  # outside the lock: a starting rank thread takes it to bind
        thread.join(max(0.0, deadline - time.monotonic()))
    with _install_lock:
        if not _users and _installed and not any(t.is_alive() for t in _rank_threads):
            _uninstall()


def _uninstall() -> None:
    global _installed
    # torch cannot report the mode; off is its default, and only this module sets it.
    torch._C._distributed_c10d._set_thread_isolation_mode(False)  # type: ignore[attr-defined]
    _upstream._uninstall_threaded_pg()
    _ddp_active.uninstall()
    tensor_meta.uninstall()
    _installed = False


def bind_domain(domain: Domain) -> None:
    """Tie the calling rank thread to its generation's Domain (read by the backend)."""
    _bound.domain = domain
    with _install_lock:
        _rank_threads.add(threading.current_thread())
