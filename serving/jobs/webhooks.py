"""Standard Webhooks: the signer and the outbox's delivery loop.

Every message carries `webhook-id` (the outbox row's id, the same on every retry and after
a restart), `webhook-timestamp` (unix seconds of this attempt) and `webhook-signature`
(`v1,<base64 HMAC-SHA256 of "id.timestamp.body">`, one per configured secret, space
separated, so a receiver keeps verifying while secrets rotate).

Delivery is at least once: a message stays pending until a 2xx. Connection errors, timeouts,
5xx and 429 are retried on the configured schedule (each wait stretched by a random jitter,
never shorter than the receiver's Retry-After); 410 Gone disables the endpoint (its pending
messages too); any other answer fails the message. Every attempt is recorded.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import random
import time
from email.utils import parsedate_to_datetime

import aiohttp

from omnistage.serving.jobs.model import Delivery, JobsConfig
from omnistage.serving.jobs.ssrf import (
    Resolver,
    UnsafeDestinationError,
    check_destination,
    needs_lookup,
    parse_allow_list,
    pinned,
)
from omnistage.serving.jobs.store import JobStore

log = logging.getLogger("omnistage.jobs")

POLL_S = 0.5  # the loop's longest sleep when nothing is due (new messages wake it sooner)
BATCH = 32
CLAIM_MARGIN_S = 30.0  # a claimed message's lease: the request timeout plus this
MAX_ANSWER_BYTES = 64 * 1024  # of a receiver's answer body, read so the connection can be reused


def sign(secret: str, msg_id: str, timestamp: int, body: str) -> str:
    """`v1,<signature>` for one `whsec_` secret."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    digest = hmac.new(key, f"{msg_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def webhook_headers(secrets: list[str], msg_id: str, timestamp: int, body: str) -> dict[str, str]:
    return {
        "content-type": "application/json",
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(sign(s, msg_id, timestamp, body) for s in secrets),
    }


def retry_after_seconds(value: str | None) -> float | None:
    """A Retry-After header (seconds or an HTTP date) as seconds from now."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


async def _drain(response: aiohttp.ClientResponse) -> None:
    """Read a receiver's answer body so its connection can serve the next message; one longer
    than MAX_ANSWER_BYTES is left unread (its connection is closed instead of reused)."""
    read = 0
    async for chunk in response.content.iter_chunked(16 * 1024):
        read += len(chunk)
        if read > MAX_ANSWER_BYTES:
            return


class WebhookSender:
    """Delivers the outbox's due messages until stopped."""

    def __init__(self, store: JobStore, config: JobsConfig, resolver: Resolver | None = None):
        self.store = store
        self.config = config
        self.allow = parse_allow_list(config.webhook_allow)
        self.resolver = resolver or Resolver(config.webhook_resolver)
        self.wake = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None

    async def run(self) -> None:
        # no proxies from the environment (trust_env off): a proxy would reach the address the
        # SSRF check pinned on the receiver's behalf, unchecked
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.config.webhook_timeout_s), trust_env=False
        )
        try:
            while True:
                lease = self.config.webhook_timeout_s + CLAIM_MARGIN_S
                due = await asyncio.to_thread(self.store.claim_deliveries, time.time(), BATCH, lease)
                if due:
                    by_url: dict[str, list[Delivery]] = {}
                    for delivery in due:
                        by_url.setdefault(delivery.url, []).append(delivery)
                    await asyncio.gather(*(self._deliver_in_order(group) for group in by_url.values()))
                    continue
                next_at = await asyncio.to_thread(self.store.next_delivery_at)
                wait = POLL_S if next_at is None else min(POLL_S, max(0.0, next_at - time.time()))
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), wait)
                except TimeoutError:
                    pass
        finally:
            await self._session.close()

    def _secrets(self, delivery: Delivery) -> list[str]:
        return [delivery.secret] if delivery.secret else list(self.config.webhook_secrets)

    async def _deliver_in_order(self, deliveries: list[Delivery]) -> None:
        """One endpoint's messages one after another, oldest first; a failure stops the rest
        until the next round (a 410 has disabled them by then)."""
        for index, delivery in enumerate(deliveries):
            if not await self._deliver(delivery):
                rest = [d.id for d in deliveries[index + 1 :]]
                if rest:  # back to the outbox for the next round, not held until their lease ends
                    await asyncio.to_thread(self.store.release_deliveries, rest)
                return

    async def _deliver(self, delivery: Delivery) -> bool:
        status, error, retry_after, refused = None, None, None, False
        started = time.monotonic()
        try:
            # resolved again now (DNS in a thread, never on the loop), and the request goes to an
            # address this check accepted
            if needs_lookup(delivery.url):
                addresses = await asyncio.to_thread(check_destination, delivery.url, self.allow, self.resolver)
            else:
                addresses = check_destination(delivery.url, self.allow, self.resolver)
            url, host, server_name = pinned(delivery.url, addresses[0])
            timestamp = int(time.time())
            headers = webhook_headers(self._secrets(delivery), delivery.id, timestamp, delivery.payload)
            async with self._session.post(
                url,
                data=delivery.payload.encode(),
                headers={**headers, **host},
                allow_redirects=False,
                server_hostname=server_name,
            ) as response:
                status = response.status
                retry_after = retry_after_seconds(response.headers.get("retry-after"))
                await _drain(response)
        except UnsafeDestinationError as exc:
            error, refused = str(exc), True
        except TimeoutError as exc:
            error = f"timeout: {exc.__class__.__name__}"
        except aiohttp.ClientError as exc:
            error = f"connection error: {exc.__class__.__name__}: {exc}"
        latency_ms = (time.monotonic() - started) * 1000
        outcome, next_at = self._outcome(delivery, status, refused, retry_after)
        await asyncio.to_thread(
            self.store.record_attempt,
            delivery,
            status_code=status,
            latency_ms=round(latency_ms, 2),
            error=error,
            outcome=outcome,
            next_attempt_at=next_at,
        )
        if status == 410:
            await asyncio.to_thread(self.store.disable_endpoint, delivery.url, "410 Gone")
        if outcome != "delivered":
            log.info("webhook %s to %s: %s (%s)", delivery.id, delivery.url, status or error, outcome)
        return outcome == "delivered"

    def _outcome(
        self, delivery: Delivery, status: int | None, refused: bool, retry_after: float | None
    ) -> tuple[str, float]:
        if status is not None and 200 <= status < 300:
            return "delivered", 0.0
        if status == 410:
            return "disabled", 0.0
        # no status: a connection error or timeout (retried), or a destination refused (not)
        retryable = (status is None and not refused) or status == 429 or (status is not None and status >= 500)
        attempts = delivery.attempts + 1
        schedule = self.config.webhook_schedule_s
        if not retryable or attempts >= len(schedule):
            return "failed", 0.0
        wait = schedule[attempts] * (1 + random.uniform(0, self.config.webhook_jitter))
        if retry_after is not None:
            wait = max(wait, retry_after)
        return "pending", time.time() + wait
