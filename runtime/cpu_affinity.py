"""CPU affinity of the server process (`omnistage serve --cpus`) and of a stage's workers
(`pool.cpus`): on a CPU-only machine a busy engine worker and the HTTP front end otherwise take
turns on the same cores, each evicting the other's caches (docs/serving.md, "CPU placement").

Workers are forked from the server (through its fork server), whose own affinity --cpus may
already have narrowed: a stage without `pool.cpus` gets the CPUs the server had before, which
`pin_process` leaves in OMNISTAGE_ALL_CPUS for them. Linux only (os.sched_setaffinity).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from omnistage.graph.fields import format_cpu_list, parse_cpu_list

ALL_CPUS_ENV = "OMNISTAGE_ALL_CPUS"


def check_cpus(cpus: Iterable[int]) -> set[int]:
    """`cpus` as a set; ValueError when this machine lacks one of them."""
    wanted, count = set(cpus), os.cpu_count() or 1
    missing = sorted(c for c in wanted if c >= count)
    if not wanted or missing:
        raise ValueError(f"no CPU {format_cpu_list(missing) or '(empty list)'} on this machine (it has 0-{count - 1})")
    return wanted


def pin_process(cpus: Iterable[int]) -> None:
    """Narrows this process to `cpus`, first noting the CPUs it had for the workers it will fork."""
    wanted = check_cpus(cpus)
    os.environ.setdefault(ALL_CPUS_ENV, format_cpu_list(os.sched_getaffinity(0)))
    os.sched_setaffinity(0, wanted)


def pin_worker(cpus: list[int] | None, worker: str) -> None:
    """A worker's affinity: its pool's `cpus`, else the server's CPUs before --cpus (if it set any).
    RuntimeError naming `worker` when this machine lacks one of `cpus` (checked at start, as
    devices are)."""
    if cpus:
        try:
            wanted = check_cpus(cpus)
        except ValueError as err:
            raise RuntimeError(f"{worker}: pool.cpus: {err}") from None
        os.sched_setaffinity(0, wanted)
    elif os.environ.get(ALL_CPUS_ENV):
        os.sched_setaffinity(0, set(parse_cpu_list(os.environ[ALL_CPUS_ENV])))
