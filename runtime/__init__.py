"""Embedded runtime: worker processes, shared-memory transport, orchestration, Pipeline API."""
