"""Imported last by the fork server: freeze its heap so workers keep sharing its pages.

Every worker is forked from the fork server after it imported torch (and whatever else the
preload list names). Those objects' pages stay shared copy-on-write only while no worker
writes to them, and the garbage collector writes to every object it scans (the gc header's
reference count copy): a worker's first full collection would copy the whole inherited
heap. `gc.freeze()` moves everything alive now into the permanent generation, which no
collection scans, so workers only pay for the pages they really modify.
"""

from __future__ import annotations

import gc

gc.collect()
gc.freeze()
