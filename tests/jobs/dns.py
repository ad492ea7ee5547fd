"""A tiny authoritative DNS server for tests (dnslib on a localhost UDP port): A records from
a dict the test changes while the server runs, every question counted."""

from __future__ import annotations

import collections

from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer


class ScriptedResolver(BaseResolver):
    def __init__(self):
        self.answers: dict[str, str] = {}  # name (no trailing dot) -> IPv4 address
        self.questions: collections.Counter[str] = collections.Counter()

    def resolve(self, request, handler):
        reply = request.reply()
        name = str(request.q.qname).rstrip(".")
        self.questions[name] += 1
        address = self.answers.get(name)
        if address is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype == QTYPE.A:
            reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=0))
        return reply  # AAAA: no answer (an empty NOERROR)


class TestDNS:
    __test__ = False

    def __init__(self):
        self.resolver = ScriptedResolver()
        self.server = DNSServer(
            self.resolver,
            address="127.0.0.1",
            port=0,
            logger=DNSLogger("-request,-reply,-truncated,-error,-recv,-send,-data"),
        )
        self.server.start_thread()
        self.address = f"127.0.0.1:{self.server.server.server_address[1]}"

    @property
    def answers(self) -> dict[str, str]:
        return self.resolver.answers

    def stop(self) -> None:
        self.server.stop()
        self.server.server.server_close()
