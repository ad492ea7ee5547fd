"""Embedded runtime: runs a PipelineSpec across worker processes on one machine.

pipeline.py      the Pipeline API (run / stream / generate / abort / stage_stats / close)
orchestrator.py  hub thread in the parent: admission, deadlines, stats, close
routing.py       the requests in flight and how their data moves between stages (Router)
recovery.py      what follows a worker's death: fail what it held, release, restart
replicas.py      replica state (ReplicaState) and the worker processes' start and stop
ledger.py        edge permits, shared-memory slots handed to stages, dead workers' segments
worker.py        one process per stage replica: the engine loop
assembler.py     transport-agnostic input assembly (fan-in join, re-chunking, concatenation)
shm.py           pooled /dev/shm segments for tensors (zero-copy reads), inline/CUDA refs
messages.py      the messages between orchestrator and workers
openmp.py        the OpenMP wait settings every started process gets
allocator.py     glibc malloc thresholds for workers (reuse freed memory, fewer page faults)
metrics.py       Prometheus collector of per-stage figures
testmodules.py   small deterministic modules for tests, the benchmark and tiny-diamond
See docs/runtime.md.
"""
