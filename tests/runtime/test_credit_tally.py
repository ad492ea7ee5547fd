"""The credit books of a stream's reader (runtime/credit.py): returns in half-window batches,
nothing held back from a producer stopped at a full window, and everything given back when a
request ends at the reader (a talker that stops before its thinker once kept the thinker's
window for good: the thinker waited forever)."""

from __future__ import annotations

import torch

from omnistage.graph.loader import load_pipeline
from omnistage.runtime.credit import CreditTally, ReturnCredit, SendCredit, data_nbytes


def test_a_return_is_due_at_half_a_window_of_chunks_or_bytes():
    tally = CreditTally({"text": (32, 2 << 20), "audio": (32, 2 << 20)})
    assert [tally.took("r", "text", 0) for _ in range(32)] == [False] * 31 + [True]
    assert tally.took("r", "audio", 1 << 20) is False and tally.took("r", "audio", 1 << 20) is True
    assert sorted(tally.due()) == [("r", "audio", 2), ("r", "text", 32)]
    assert tally.due() == [] and not tally.has_due()


def test_a_paused_reader_keeps_its_due_credit_until_it_goes_on():
    tally = CreditTally({0: (2, 1 << 30)})
    for rid in ("a", "b", "a", "b"):
        tally.took(rid, 0, 0)
    assert tally.due(skip={"a"}) == [("b", 0, 2)]
    assert tally.has_due()
    assert tally.due() == [("a", 0, 2)]


def test_a_producer_stopped_at_a_full_window_always_gets_credit_back():
    """Whatever the mix of chunk sizes, once every chunk of a full window reached the reader,
    a return is due: the producer can always go on."""
    spec = load_pipeline("tiny-omni")
    edge = ReturnCredit(spec, "talker").edge_of_port["talker_embeds"]
    window_chunks, window_bytes = SendCredit(spec, "thinker").limits[edge]
    for sizes in ([0] * window_chunks, [3 << 20, 2 << 20], [1 << 20] * 4, [100] * 63 + [4 << 20]):
        thinker, talker = SendCredit(spec, "thinker"), ReturnCredit(spec, "talker")
        stopped = False
        for size in sizes:
            stopped = thinker.sent("r", edge, size) or stopped
            talker._tally.took("r", edge, size)
        assert stopped, sizes
        (grant,) = talker.take_grants(paused=set())
        assert thinker.granted(*grant), sizes
    assert (window_chunks, window_bytes) == (64, 4 << 20)


def test_a_request_that_ends_at_the_reader_gives_back_what_it_took():
    spec = load_pipeline("tiny-omni")
    talker = ReturnCredit(spec, "talker")
    edge = talker.edge_of_port["talker_embeds"]
    for _ in range(40):
        talker.took("r", "talker_embeds", None)
    # paused by its own consumer: nothing goes back while it is paused ...
    assert talker.take_grants(paused={"r"}) == []
    # ... but when it ends there (the talker stops before the thinker), all of it does
    assert talker.release("r") == [("r", edge, 40)]
    assert talker.release("r") == []


def test_decoded_chunks_count_their_tensor_bytes():
    assert data_nbytes(torch.zeros(10, 4)) == 160
    assert data_nbytes({"h": torch.zeros(2, dtype=torch.float16), "ids": [1, 2]}) == 4
    assert data_nbytes("text") == 0 and data_nbytes([5, 6, 7]) == 0
