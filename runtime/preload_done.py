"""Imported last by the fork server: freeze its heap so workers keep sharing its pages, and
keep it alive through a SIGTERM sent to the whole process group.

Every worker is forked from the fork server after it imported torch (and whatever else the
preload list names). Those objects' pages stay shared copy-on-write only while no worker
writes to them, and the garbage collector writes to every object it scans (the gc header's
reference count copy): a worker's first full collection would copy the whole inherited
heap. `gc.freeze()` moves everything alive now into the permanent generation, which no
collection scans, so workers only pay for the pages they really modify.

SIGTERM: multiprocessing's fork server ignores SIGINT but not SIGTERM. A service manager's
stop (SIGTERM to every process of the group) killed it, and its death reads, in the parent,
as the death of every worker it forked (their exit status travels through it: 255), while
the workers themselves were alive: their requests failed, the hub started new ones from a
new fork server during the drain, and a slow stop left files behind. Like the workers, it
now leaves stopping to the parent; it exits when the parent does.
"""

from __future__ import annotations

import gc
import signal

gc.collect()
gc.freeze()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
