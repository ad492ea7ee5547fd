"""The SSRF guard asks DNS again at delivery: a webhook host that resolved to an allowed
address when the job was submitted and resolves to a private one when its event is delivered
is refused then. The answers come from a real DNS server the test runs (tests/jobs/dns.py),
which the server is told to use (OMNISTAGE_WEBHOOK_RESOLVER)."""

from __future__ import annotations

import httpx

from omnistage.tests.jobs.conftest import WebhookReceiver, image_job, wait_for, wait_status


def test_a_host_moved_to_a_private_address_after_submission_is_refused_at_delivery(jobs_server, receiver, dns_server):
    port = receiver.server.server_address[1]
    dns_server.answers["moved.hooks.test"] = "127.0.0.1"  # the allow list has 127.0.0.0/8
    dns_server.answers["steady.hooks.test"] = "127.0.0.1"
    with httpx.Client(base_url=jobs_server.url, timeout=60) as client:
        moved = client.post("/v1/jobs", json=image_job(webhook={"url": f"http://moved.hooks.test:{port}/moved"}))
        steady = client.post("/v1/jobs", json=image_job(webhook={"url": f"http://steady.hooks.test:{port}/steady"}))
        assert moved.status_code == 202 and steady.status_code == 202, (moved.text, steady.text)
        dns_server.answers["moved.hooks.test"] = "10.20.30.40"  # rebinds before the job ends
        wait_status(client, moved.json()["id"], ("completed",))
        wait_status(client, steady.json()["id"], ("completed",))
        # the steady name reaches the receiver at the address the test's DNS gave (the system
        # resolver knows neither name)
        got = wait_for(lambda: receiver.at("/steady"), what="the steady host's delivery")
        assert got[0].body["data"]["id"] == steady.json()["id"] and not receiver.rejected

        def refused():
            attempts = client.get(f"/v1/jobs/{moved.json()['id']}").json()["webhook"]["attempts"]
            return attempts if attempts and attempts[0]["error"] else None

        attempts = wait_for(refused, what="the moved host's refused attempt")
    assert len(attempts) == 1, attempts  # a refused destination is not retried
    assert attempts[0]["status_code"] is None
    assert "resolves to 10.20.30.40" in attempts[0]["error"], attempts
    assert not receiver.at("/moved")
    assert dns_server.resolver.questions["moved.hooks.test"] >= 2  # at submission and at delivery


def test_a_webhook_host_the_dns_server_does_not_know_is_a_400(jobs_server, dns_server):
    with httpx.Client(base_url=jobs_server.url, timeout=60) as client:
        r = client.post("/v1/jobs", json=image_job(webhook={"url": "http://unknown.hooks.test/x"}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "webhook_url_not_allowed" and error["param"] == "webhook.url"
    assert "does not resolve" in error["message"] and "NXDOMAIN" in error["message"]


def test_an_https_webhook_goes_to_the_checked_address_under_its_name(jobs_server, dns_server, webhook_ca):
    """The connection is pinned to the address the SSRF check accepted, and TLS still speaks the
    host name: SNI carries it and the certificate must be for it (a receiver whose certificate
    names another host is not delivered to)."""
    ca, _ = webhook_ca
    right = WebhookReceiver(tls=ca.issue_cert("tls.hooks.test"))
    wrong = WebhookReceiver(tls=ca.issue_cert("someone-else.test"))
    dns_server.answers["tls.hooks.test"] = "127.0.0.1"
    dns_server.answers["wrong-cert.hooks.test"] = "127.0.0.1"
    try:
        with httpx.Client(base_url=jobs_server.url, timeout=60) as client:
            good = client.post("/v1/jobs", json=image_job(webhook={"url": right.url("/tls", "tls.hooks.test")}))
            bad = client.post("/v1/jobs", json=image_job(webhook={"url": wrong.url("/tls", "wrong-cert.hooks.test")}))
            assert good.status_code == 202 and bad.status_code == 202, (good.text, bad.text)
            got = wait_for(lambda: right.at("/tls"), what="the HTTPS delivery")
            assert got[0].body["data"]["id"] == good.json()["id"] and not right.rejected
            assert right.server_names and set(right.server_names) == {"tls.hooks.test"}

            def failed_attempt():
                attempts = client.get(f"/v1/jobs/{bad.json()['id']}").json()["webhook"]["attempts"]
                return attempts if attempts and attempts[0]["error"] else None

            attempts = wait_for(failed_attempt, what="the attempt on a certificate for another name")
        assert attempts[0]["status_code"] is None and "certificate" in attempts[0]["error"].lower(), attempts
        assert not wrong.received
    finally:
        right.close()
        wrong.close()
