"""A real `omnistage serve` with jobs in a temporary directory, and a local webhook receiver."""

from __future__ import annotations

import base64
import json
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from omnistage.tests.serving.conftest import ServerProcess, start_server

SECRET = "whsec_" + base64.b64encode(b"omnistage-jobs-test-secret-0001").decode()
OLD_SECRET = "whsec_" + base64.b64encode(b"omnistage-jobs-test-secret-0000").decode()
FAST_SCHEDULE = "0,0.3,0.6,1.0,1.5,2.0,3.0"  # the spec's schedule, compressed


def jobs_env(directory: Path, **extra: str) -> dict[str, str]:
    return {
        "OMNISTAGE_JOBS_DIR": str(directory),
        "OMNISTAGE_WEBHOOK_SECRETS": f"{SECRET},{OLD_SECRET}",
        "OMNISTAGE_WEBHOOK_SCHEDULE": FAST_SCHEDULE,
        "OMNISTAGE_WEBHOOK_ALLOW": "127.0.0.0/8",
        "OMNISTAGE_JOBS_RETENTION_S": "3600",
        **extra,
    }


def start_jobs_server(args: list[str], log_path: Path, env: dict[str, str], port: int | None = None) -> ServerProcess:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        return start_server(args, log_path, port=port)


@pytest.fixture(scope="session")
def dns_server():
    """A DNS server on a localhost UDP port whose answers a test sets (tests/jobs/dns.py)."""
    from omnistage.tests.jobs.dns import TestDNS

    server = TestDNS()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="package")
def webhook_ca(tmp_path_factory):
    """A certificate authority (trustme) the jobs server trusts for HTTPS webhooks."""
    import trustme

    ca = trustme.CA()
    path = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return ca, path


@pytest.fixture(scope="package")
def jobs_server(tmp_path_factory, dns_server, webhook_ca):
    """tiny-image with jobs; one job at a time per model, so later ones stay queued (one for
    the folder: its tests look only at the jobs they create); webhook host names looked up at
    `dns_server`; HTTPS receivers verified against `webhook_ca` only; a job whose stage worker
    dies runs at most twice."""
    base = tmp_path_factory.mktemp("jobs")
    env = jobs_env(
        base / "jobs",
        SSL_CERT_FILE=str(webhook_ca[1]),
        SSL_CERT_DIR=str(webhook_ca[1].parent),
        OMNISTAGE_JOBS_MAX_RUNNING="1",
        OMNISTAGE_WEBHOOK_RESOLVER=dns_server.address,
        OMNISTAGE_JOBS_MAX_ATTEMPTS="2",
        OMNISTAGE_JOBS_RETRY_BACKOFF_S="0.2",
    )
    server = start_jobs_server(["tiny-image"], base / "server.log", env)
    try:
        server.wait_ready(timeout=300)
        yield server
    finally:
        server.stop()


def image_job(steps: int = 4, seed: int = 1, **extra) -> dict:
    return {
        "model": "tiny-image",
        "inputs": {"prompt": "a red cube"},
        "params": {"denoiser": {"width": 64, "height": 64, "num_inference_steps": steps, "seed": seed}},
        **extra,
    }


def wait_status(client: httpx.Client, job_id: str, statuses: tuple[str, ...], timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in statuses:
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} not {statuses} after {timeout}s: {job}")


@dataclass
class Received:
    path: str
    msg_id: str
    body: dict
    at: float


@dataclass
class WebhookReceiver:
    """A local HTTP server answering each path from a script of statuses (the last repeats).

    Every request is verified with the `standardwebhooks` package against `secret` before it
    is recorded; an unverifiable one is recorded in `rejected` and answered 400."""

    secret: str = SECRET
    scripts: dict[str, list[tuple[int, dict[str, str]]]] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    tls: Any = None  # a trustme LeafCert: serve HTTPS with it, recording each handshake's SNI name
    server_names: list[str | None] = field(default_factory=list)

    def __post_init__(self):
        from standardwebhooks.webhooks import Webhook

        receiver = self
        verifier = Webhook(self.secret)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                try:
                    payload = verifier.verify(body, dict(self.headers.items()))
                except Exception as exc:  # noqa: BLE001 - the test reports what failed
                    receiver.rejected.append(f"{self.path}: {exc}")
                    self.send_response(400)
                    self.end_headers()
                    return
                receiver.received.append(Received(self.path, self.headers["webhook-id"], payload, time.monotonic()))
                script = receiver.scripts.get(self.path) or [(200, {})]
                count = sum(1 for r in receiver.received if r.path == self.path)
                status, headers = script[min(count, len(script)) - 1]
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if self.tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.tls.configure_cert(context)
            context.sni_callback = lambda sock, name, ctx: self.server_names.append(name)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{host}:{self.server.server_address[1]}{path}"

    def at(self, path: str) -> list[Received]:
        return [r for r in self.received if r.path == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = WebhookReceiver()
    try:
        yield r
    finally:
        r.close()


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def sse_events(text: str) -> list[tuple[str, str, dict]]:
    """(id, event, data) of every event in an SSE body."""
    out = []
    for block in text.strip().split("\n\n"):
        fields = {}
        for line in block.split("\n"):
            if line.startswith(":") or ":" not in line:
                continue
            key, _, value = line.partition(":")
            fields[key] = value.strip()
        if "data" in fields:
            out.append((fields.get("id", ""), fields.get("event", ""), json.loads(fields["data"])))
    return out


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server (tests/jobs/postgres.py), skipped with the reason when none starts."""
    from omnistage.tests.jobs.postgres import start_postgres

    server = start_postgres()
    if isinstance(server, str):
        pytest.skip(server)
    try:
        yield server
    finally:
        server.stop()
