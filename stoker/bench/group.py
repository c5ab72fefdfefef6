"""A throwaway gloo group of worker processes for the benchmarks that time collectives directly."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stoker.training.rendezvous import StoreAddress


def run_group(worker: Callable[..., Any], world: int, args: tuple, timeout_s: float) -> Any:
    """Start `world` processes running `worker(rank, world, *args)` in one gloo group; return rank 0's result.

    A worker's exception comes back as a RuntimeError naming the rank; every process is gone when this returns."""
    from stoker.common.procs import CONTEXT  # here, not at the top: `stoker --help` must not wait for torch
    from stoker.training.rendezvous import LocalStore

    store = LocalStore()
    results = CONTEXT.Queue()
    processes = [CONTEXT.Process(target=_member, args=(worker, rank, world, store.address, timeout_s, args, results))
                 for rank in range(world)]
    for process in processes:
        process.start()
    try:
        outcome = results.get(timeout=timeout_s)
    except BaseException:  # interrupted or timed out: no member's result is waited for
        for process in processes:
            process.kill()
        raise
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
        store.close()
    if isinstance(outcome, BaseException):
        raise RuntimeError(str(outcome))
    return outcome


def _member(worker: Callable[..., Any], rank: int, world: int, address: StoreAddress, timeout_s: float, args: tuple,
            results) -> None:
    import torch
    import torch.distributed as dist

    from stoker.training.rendezvous import bind_to_loopback

    try:
        torch.set_num_threads(1)
        bind_to_loopback()
        dist.init_process_group("gloo", store=address.connect(world, timeout_s), rank=rank, world_size=world)
        result = worker(rank, world, *args)
        if rank == 0:
            results.put(result)
    except Exception as error:  # carried to the parent as a value
        results.put(RuntimeError(f"rank {rank}: {type(error).__name__}: {error}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
