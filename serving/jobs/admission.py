"""SubmitBatcher: the submissions that arrive together are stored in one transaction.

A POST /v1/jobs hands its validated job to the batcher and awaits the result, which comes only
after the transaction holding its row has committed (serving/jobs/group_commit.py): under a
burst, one commit (and one queue-position count per model) serves many requests. On SQLite
the commit runs on the event loop (about a millisecond; in a thread it waited on the GIL).
"""

from __future__ import annotations

from omnistage.serving.jobs.group_commit import GroupCommitter
from omnistage.serving.jobs.model import Admitted, Job
from omnistage.serving.jobs.store import JobStore


class SubmitBatcher(GroupCommitter[Job, Admitted]):
    def __init__(self, store: JobStore, max_queued_per_owner: int | None):
        super().__init__(lambda jobs: store.create_jobs(jobs, max_queued_per_owner), inline=store.inline_writes)
        self.store = store
        self.max_queued_per_owner = max_queued_per_owner
