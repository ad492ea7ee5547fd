"""Asynchronous jobs over any hosted pipeline (docs/jobs.md).

store.py      JobStore interface + SQLite implementation (WAL, versioned migrations)
model.py      JobStatus, Job, JobEvent, JobsConfig: the state that crosses module boundaries
group_commit.py  writes that arrive together share one transaction, in a thread (submissions, events)
scheduler.py  feeds the runtime's admission from the store, records progress, events, outputs;
              reruns a job whose stage worker died
outputs.py    a finished job's ports as files under the outputs directory
webhooks.py   Standard Webhooks signer and the persistent outbox's delivery loop
ssrf.py       refuses webhook destinations on private, loopback, link-local, metadata addresses
              (resolved again, and pinned, at every delivery)
service.py    JobService: the pieces above wired together, started and stopped with the app
"""
