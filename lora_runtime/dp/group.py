"""``DPGroup``: this rank's place in the data-parallel group and its two process groups: one
for the model's collectives (NCCL on GPUs, gloo on CPUs) and a gloo one for the host-side
step agreement. Collective timeouts are set here, never left at the defaults (tens of
minutes), so a dead or failing rank stops the others with an error in bounded time."""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lora_runtime.checks import is_positive_number

DEFAULT_TIMEOUT_S = 60.0
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1e-3, 1e9
"""torch counts the timeout in whole milliseconds (below 1 ms it was 0: the store's first
connection timed out at once) and in nanoseconds somewhere (past ~9e9 s it wrapped negative,
and past ~8.6e13 s ``timedelta`` raised OverflowError naming neither)."""

# This process's DP state, shared by its DPGroups (``shutdown`` leaves every group at once).
_epoch = 0
"""Bumped by ``shutdown``: a DPGroup made before it is closed (``DPGroup.closed``)."""
_fault: tuple[str, str] | None = None
"""(what, error) of the first fault that left this rank out of its peers' lockstep (a
forward that raised mid-step, a host collective that failed), until ``shutdown``."""
_wait_s = DEFAULT_TIMEOUT_S
"""The last ``init_dp``'s timeout: ``shutdown`` waits for the other ranks that long at most."""
_store_exchanges = 0
"""``exchange_through_store`` calls since ``init_dp`` (their number names their keys)."""
_joins = 0
"""``init_dp`` calls in this process (every rank makes as many): the store's keys name it, as
``init_dp`` restarts ``_store_exchanges``. A second ``init_dp`` in the same world (no
``shutdown`` between: the same epoch and store) once reused the first one's keys, and a
rank's set-up check read a peer's earlier answer at once instead of waiting for its new one
(a DPEngine built with other settings on that peer passed the check on this rank)."""
_rendezvous: tuple[tuple[str, ...], dist.Store] | None = None
"""(the environment it was made from, the store) of the first world this process joined: every
later world of that environment meets in it (``_join_world``)."""
_joined: list[tuple[object, list, bool]] = []
"""(the world's default group, the groups ``init_dp`` made, whether it made the world too) for
each ``init_dp`` since ``shutdown``, which destroys only the groups of a world the caller made."""


def _current_epoch() -> int:
    return _epoch


@dataclass(frozen=True)
class DPGroup:
    rank: int
    size: int
    group: dist.ProcessGroup
    """The model's collectives (gather before the MLP, reduce-scatter after)."""
    cpu_group: dist.ProcessGroup
    """Host-side agreement (gloo)."""
    timeout_s: float
    epoch: int = field(default_factory=_current_epoch, repr=False, compare=False)
    """The ``shutdown`` count when the group was made: a later ``shutdown`` closes it."""

    @property
    def name(self) -> str:
        return f"dp rank {self.rank}/{self.size}"

    @property
    def closed(self) -> bool:
        """Whether ``shutdown`` (or ``destroy_process_group``) has left the group."""
        return self.epoch != _epoch or not dist.is_initialized()

    def check_open(self, what: str) -> None:
        """Raises, before any collective, where the group was shut down: its process groups
        are gone (a step's agreement still paired over the torn-down gloo group when every
        rank made it, and the MLP's all-gather failed with "Could not resolve the process
        group", taken for a fault mid-step)."""
        if self.closed:
            raise RuntimeError(f"{what}: {self.name}'s process group was shut down "
                               "(lora_runtime.dp.group.shutdown): join a new group with init_dp "
                               "on every rank and build a new DPEngine on it")

    @property
    def fault(self) -> tuple[str, str] | None:
        """(what, error) of the fault that left this rank out of the ranks' lockstep, if any
        (``mark_fault``), until ``shutdown``."""
        return None if self.closed else _fault


def mark_fault(dp: DPGroup, what: str, error: str) -> None:
    """Records that this rank left its peers' lockstep (``what``: a forward that raised
    mid-step, a host collective that failed; the first one is kept): every DPEngine on the
    group refuses its later calls, and ``shutdown`` leaves without waiting for the peers (they
    may be held in a collective this rank will never join)."""
    global _fault
    if _fault is None and not dp.closed:
        _fault = (what, error)


def exchange_through_store(dp: DPGroup, what: str, value: str) -> list[str]:
    """Every rank's ``value``, by rank, through the store: no gloo pair, so a call that only
    some ranks make waits out the timeout and raises naming the ranks that did not make it,
    instead of meeting another call's host all-gather of another size (gloo aborted the
    process: "Received data size doesn't match expected size"). Every rank makes these calls
    in the same order: their count names them."""
    global _store_exchanges
    n, _store_exchanges = _store_exchanges, _store_exchanges + 1
    store = dist.distributed_c10d._get_default_store()
    # The epoch: a store may outlive a world (one the caller made) and hold its keys.
    keys = [f"dp_exchange/{_epoch}/{_joins}/{n}/{r}" for r in range(dp.size)]
    store.set(keys[dp.rank], value)
    try:
        store.wait(keys, datetime.timedelta(seconds=dp.timeout_s))
    except Exception as e:
        missing = _missing(store, keys)
        if missing != []:  # (none: they came just after the timeout)
            said = ("the store, on rank 0, is gone" if missing is None
                    else f"ranks {missing} did not reach it within {dp.timeout_s:g} s")
            mark_fault(dp, f"the {what} went unmet", said)
            raise RuntimeError(f"{dp.name}: {what}: {said}. Every rank makes the same DPEngine "
                               "calls in the same order, building its DPEngines too; DP does "
                               "not recover from faults: restart every rank") from e
    return [store.get(k).decode() for k in keys]


def _missing(store, keys: list[str]) -> list[int] | None:
    """The ranks whose key is not in the store (None: the store, on rank 0, is gone)."""
    try:
        return [r for r, k in enumerate(keys) if not store.check([k])]
    except Exception:  # noqa: BLE001
        return None


def init_dp(device: torch.device | str, timeout_s: float | None = None) -> DPGroup:
    """Joins the group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) on ``device``: on GPUs, by torchrun's convention, cuda:LOCAL_RANK (``spawn``
    makes it current; under torchrun call ``torch.cuda.set_device`` first). The collectives'
    timeout: DP_TIMEOUT_S where set, else ``timeout_s``, else ``DEFAULT_TIMEOUT_S``."""
    global _wait_s, _store_exchanges, _joins
    device = _as_device(device, "init_dp")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(f"{var} is not set: launch the ranks with torchrun or "
                               "lora_runtime.dp.launch.spawn")
    timeout_s = resolved_timeout_s(timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        # The caller's group keeps the caller's timeout (torch's default: 10-30 minutes, which
        # a dead rank's peers would wait out): the DP collectives get a group of their own.
        group, ours = dist.new_group(backend=backend, timeout=timeout), False
    else:
        _join_world(backend, timeout, device)
        group, ours = dist.group.WORLD, True
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else group
    _joined.append((dist.group.WORLD, list(dict.fromkeys([group, cpu_group])), ours))
    _wait_s, _store_exchanges, _joins = timeout_s, 0, _joins + 1
    return DPGroup(dist.get_rank(), dist.get_world_size(), group, cpu_group, timeout_s)


def _as_device(device, what: str) -> torch.device:
    """``device`` as a torch.device (a name, "cpu" or "cuda:0", is one); refused naming it
    before any group or store work (a name once raised "'str' object has no attribute
    'type'", and ``shutdown`` did so before leaving: its peers waited out the timeout)."""
    try:
        return torch.device(device)
    except (TypeError, RuntimeError, ValueError) as e:
        raise ValueError(f"{what}: device must be a torch.device or a device name ('cpu', "
                         f"'cuda:0'), got {device!r}") from e


def _join_world(backend: str, timeout: datetime.timedelta, device: torch.device) -> None:
    """``init_process_group`` from torchrun's environment, in a store kept for the process's
    later worlds, under keys of this join. Hazard: after ``shutdown`` a rank may join again
    while rank 0, whose process hosts the store, is still leaving (or holds the old world's
    objects): a fresh rendezvous on MASTER_PORT met the old store and its old gloo addresses,
    and every rank failed on gloo's connect ("Connect timeout", "Connection reset by peer")."""
    global _rendezvous
    env = tuple(os.environ[v] for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"))
    if _rendezvous is None or _rendezvous[0] != env:
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        _rendezvous = (env, store)
    store = _rendezvous[1]
    store.set_timeout(timeout)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.PrefixStore(f"dp_world/{_joins}", store),
                            rank=int(env[2]), world_size=int(env[3]), timeout=timeout, **kwargs)


def resolved_timeout_s(timeout_s: float | None) -> float:
    """The collectives' timeout in seconds: a finite number in [MIN_TIMEOUT_S, MAX_TIMEOUT_S]
    (0 timed the first connection out at once, NaN and text raised from the conversion naming
    neither, and an explicit 0 was read as the default)."""
    env = os.environ.get("DP_TIMEOUT_S")
    if env is not None:
        try:
            value = float(env)
        except ValueError:
            value = None
        if value is None or not _in_range(value):
            raise ValueError(f"DP_TIMEOUT_S={env!r}: set it to a number of seconds from "
                             f"{MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g} (the collectives' timeout), "
                             "or unset it")
        return value
    return DEFAULT_TIMEOUT_S if timeout_s is None else checked_timeout_s(timeout_s)


def checked_timeout_s(timeout_s) -> float:
    """``timeout_s`` as a float, refused naming it unless a number of seconds in
    [MIN_TIMEOUT_S, MAX_TIMEOUT_S]."""
    if not _in_range(timeout_s):
        raise ValueError(f"timeout_s must be a number of seconds from {MIN_TIMEOUT_S:g} to "
                         f"{MAX_TIMEOUT_S:g} (the collectives' timeout), got {timeout_s!r}")
    return float(timeout_s)


def _in_range(timeout_s) -> bool:
    return is_positive_number(timeout_s) and MIN_TIMEOUT_S <= timeout_s <= MAX_TIMEOUT_S


def shutdown(device: torch.device | str) -> None:
    """Synchronises and leaves the group (graphs must be released first: a process holding
    captured collectives may not exit on its own): the world too where ``init_dp`` made it,
    else only the groups it made in the caller's world. Every rank calls it after its last
    DPEngine call; it waits for the others (``init_dp``'s timeout at most, then raises naming
    the ranks that did not come, having left). A rank that faulted (``mark_fault``) leaves at
    once: its peers may be held in a collective it will never join (they fail when its process
    ends, or at the timeout). Afterwards every DPGroup of the process is closed (``check_open``).
    Where this process has no DP group in the world (shut down already, or no ``init_dp``) it
    returns at once.
    Hazard: after a gloo collective failed (a timeout, a peer gone), the process may still
    abort while exiting, as the interpreter tears the pairs down ("terminate called without
    an active exception"; about 1 exit in 25 on gloo CPU ranks): leave by ``os._exit`` once
    the error is reported."""
    global _epoch, _fault, _store_exchanges
    device = _as_device(device, "shutdown")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if not dist.is_initialized():
        return
    if not any(world is dist.group.WORLD for world, _, _ in _joined):
        # No DP group in this world (shut down already, or no init_dp): nothing to leave. It
        # waited out the timeout for peers that had left, and destroyed the caller's world.
        return
    fault, timeout_s, epoch = _fault, _wait_s, _epoch
    _epoch += 1  # every DPGroup is closed from here on, whatever happens below
    _fault, _store_exchanges = None, 0
    # Every backend waits through the store: an NCCL rank that destroyed its communicator
    # at once left a peer still stepping held in its next collective until NCCL's timeout,
    # with no error naming the rank that had left.
    # Hazard: a rank that tears its gloo pairs down while a peer still completes the last
    # collective aborts that peer ("terminate called without an active exception", SIGABRT;
    # seen in CI and in a bench run on 2 cores, once with a barrier before the teardown: the
    # barrier is itself a collective a peer may still be finishing). So no collective here:
    # through the store (no gloo pair) every rank says it has returned from its last
    # collective, each waits until all have, and the store's host (rank 0) leaves last.
    # A gloo barrier also never paired after a fault: the peers were held in the step's
    # collectives, and the barrier waited out the timeout, raising gloo's "Timed out".
    rank, size = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()

    def key(step: str, r: int) -> str:  # the epoch: a store may outlive a world
        return f"dp_shutdown/{epoch}/{step}/{r}"

    if fault is not None:
        _quietly(store.set, key("arrived", rank), "fault")
        _leave()
        _quietly(store.set, key("left", rank), "1")
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    arrived = [key("arrived", r) for r in range(size)]
    try:
        try:
            store.set(arrived[rank], "ok")
            store.wait(arrived, timeout)
        except Exception as e:  # a timeout, or the store gone
            missing = _missing(store, arrived)
            if missing != []:  # (none: they came just after the timeout)
                raise RuntimeError(_unmet(f"dp rank {rank}/{size}", missing, timeout_s,
                                          e)) from e
        if rank == 0:  # every rank returned from its collectives: a late "left" harms none
            _quietly(store.wait, [key("left", r) for r in range(1, size)], timeout)
    finally:
        _leave()
    if rank != 0:
        _quietly(store.set, key("left", rank), "1")


def _leave() -> None:
    """Destroys the world where ``init_dp`` made it, else only the groups it made in the
    caller's world (destroyed, the caller's next collective raised "Default process group has
    not been initialized")."""
    global _joined
    world = dist.group.WORLD
    joined, _joined = [j for j in _joined if j[0] is world], []
    if not joined or any(ours for _, _, ours in joined):
        dist.destroy_process_group()
        return
    for _, groups, _ in joined:
        for group in groups:
            dist.destroy_process_group(group)


def _unmet(name: str, missing: list[int] | None, timeout_s: float, error: Exception) -> str:
    if missing is None:
        return (f"{name}: shutdown could not reach the group's store, on rank 0 ({error}): "
                "rank 0 left first (its process ended, or a fault made it leave at once); "
                "this rank left the group")
    return (f"{name}: shutdown waited {timeout_s:g} s for ranks {missing} to reach shutdown() "
            "(every rank calls it after its last DPEngine call; a rank still stepping waits "
            "in a collective until the timeout); this rank left the group")


def _quietly(fn, *args) -> None:
    """``fn(*args)``, a store call whose failure leaves nothing to do: a rank that faulted,
    or whose peers have all returned from their collectives, leaves anyway."""
    with contextlib.suppress(Exception):
        fn(*args)
