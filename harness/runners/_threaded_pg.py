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
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions, ReduceScatterOptions
from torch.testing._internal.distributed import multi_threaded_pg as _upstream

BACKEND = "threaded"
# Operations this process group cannot serve, named as World.lacks names them.
UNSUPPORTED = frozenset(
    {
        "reduce_scatter.max",
        "reduce_scatter.min",
        "reduce_scatter.product",
        "send",
        "recv",
        "reduce",
        "monitored_barrier",
    }
)

_install_lock = threading.Lock()
_installed = False
_bound = threading.local()


class CollectiveAborted(BaseException):
    """Raised in a rank waiting in a collective that will never complete.

    A ``BaseException`` so that a check's ``except Exception`` cannot swallow the release.
    """


class RunnerUnsupported(RuntimeError):
    """An operation the threaded process group does not implement."""


class _Rendezvous:
    __slots__ = ("arrived", "cond", "data", "done", "error", "size", "work")

    def __init__(self, size: int, work: Any, lock: threading.Lock) -> None:
        self.size, self.work = size, work
        # One condition per collective, sharing the domain's lock: completing a collective
        # wakes its own participants only, not every rank waiting on another mesh axis.
        self.cond = threading.Condition(lock)
        self.data: list[Any] = [None] * size
        self.arrived = 0
        self.done = False
        self.error: BaseException | None = None


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

    def where(self, rank: int) -> str | None:
        with self.lock:
            return self.waiting_in.get(rank)

    def join(self, pg: DistconfThreadedGroup, name: str, work: Any, data: Any) -> Any:
        key, group_rank, rank = pg.pg_name, pg.group_rank, pg.global_rank
        with self.lock:
            if self.aborted:
                raise CollectiveAborted(f"{name} on group {key} not started: {self.abort_reason}")
            rv = self.inflight.get(key)
            if rv is None:
                rv = self.inflight[key] = _Rendezvous(pg.size(), work, self.lock)
            rv.data[group_rank] = data
            rv.arrived += 1
            if rv.arrived == rv.size:
                del self.inflight[key]
                self._complete(rv)
            else:
                self.waiting_in[rank] = f"{name} on group {key}"
                rv.cond.wait_for(lambda: rv.done or self.aborted)
                self.waiting_in.pop(rank, None)
                if not rv.done:
                    raise CollectiveAborted(
                        f"released from {name} on group {key}: {self.abort_reason}"
                    )
            if rv.error is not None:
                raise RuntimeError(f"{name} on group {key} failed: {rv.error!r}") from rv.error
        return _upstream.ret_work(data)

    def _complete(self, rv: _Rendezvous) -> None:
        try:
            rv.work.work(rv.data)
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

    def _join(self, name: str, work: Any, data: Any) -> Any:
        return self.domain.join(self, name, work, data)

    def allreduce(self, tensor_list: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else AllreduceOptions()
        return self._join("allreduce", _upstream.AllReduce(opts.reduceOp), tensor_list)

    def allreduce_coalesced(self, tensor_list: Any, opts: Any = None) -> Any:
        return self.allreduce(tensor_list, opts)

    def allgather(self, output_tensors: Any, input_tensor: Any, opts: Any = None) -> Any:
        return self._join("allgather", _upstream.AllGather(), (output_tensors, input_tensor))

    def broadcast(self, tensor_list: Any, opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        return self._join("broadcast", _upstream.Broadcast(root), tensor_list)

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        return self._join("scatter", _upstream.Scatter(root), (output_tensors, input_tensors))

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        return self._join("gather", _upstream.Gather(root), (output_tensors, input_tensors))

    def reduce_scatter(self, output_tensor: Any, scatter_list: Any, opts: Any = None) -> Any:
        op = (opts if opts is not None else ReduceScatterOptions()).reduceOp
        kind = getattr(op, "op", op)  # a ReduceOp wraps its RedOpType in .op
        if kind not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise RunnerUnsupported(
                f"reduce_scatter with {kind} is unsupported on the thread runner "
                "(the threaded process group implements only SUM and AVG)"
            )
        return self._join(
            "reduce_scatter", _upstream.ReduceScatter(op), (output_tensor, scatter_list)
        )

    def alltoall(self, output_tensor_list: Any, input_tensor_list: Any, opts: Any = None) -> Any:
        return self._join("alltoall", _upstream.AllToAll(), (output_tensor_list, input_tensor_list))

    def all_to_all_single(
        self,
        output_buffer: torch.Tensor,
        input_buffer: torch.Tensor,
        output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None,
        opts: Any = None,
    ) -> Any:
        data = (output_buffer, input_buffer, output_split_sizes, input_split_sizes)
        return self._join("all_to_all_single", _upstream.AllToAllBase(), data)

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
    # has created this group before any of them uses it (as upstream does).
    _upstream._store_based_barrier(rank, prefix_store, "", world_size, timeout)
    return pg


def install() -> None:
    """Make c10d's world thread-local and register our backend; idempotent."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _upstream._install_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(True)  # type: ignore[attr-defined]
        dist.Backend.register_backend(BACKEND, _create_group, devices=["cpu", "cuda"])
        _installed = True


def forget_dead_threads() -> None:
    """Drop DTensor's process-wide caches keyed by thread ident; call when new ranks start.

    ``DeviceMesh`` on the threaded backend compares and hashes by ``threading.get_ident()``.
    Two process-wide caches hold rank-dependent values under such keys: the planner cache
    (``get_redistribute_planner``, whose planner keeps its mesh, so the entry never dies) and
    ``_gen_transform_infos`` (the logical shapes of uneven shards). The OS reuses the ident
    of an exited thread, so a new rank thread can be served another rank's plan from a
    retired generation, and its collectives then disagree with its peers' ("size of tensor a
    (5) must match the size of tensor b (4)"). Upstream's MultiThreadedTestCase starts new
    threads for every test and shares the hazard.
    """
    from torch.distributed.tensor import _redistribute

    clears: list[Any] = [
        getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
    ]
    for clear in clears:
        if not callable(clear):
            raise RuntimeError(
                "torch.distributed.tensor._redistribute no longer has "
                "_gen_transform_infos.cache_clear and clear_redistribute_planner_cache: "
                "review forget_dead_threads for this torch version"
            )
        clear()


def bind_domain(domain: Domain) -> None:
    """Tie the calling rank thread to its generation's Domain (read by the backend)."""
    _bound.domain = domain
