"""Input assembly without processes: fan-in join, re-chunking with left context, concatenation."""

import torch

from omnistage.graph.spec import StreamSpec
from omnistage.runtime.assembler import InputAssembler, Rechunker
from omnistage.runtime.messages import RequestMeta


def reference_chunks(seq, chunk, left):
    """Independent statement of the streaming contract: new items [s, s+chunk) preceded by the
    `left` items before s; an empty closing chunk when the length divides evenly."""
    out = [seq[max(0, s - left) : s + chunk] if s else seq[:chunk] for s in range(0, len(seq), chunk)]
    if len(seq) % chunk == 0:
        out.append(seq[:0])
    return out


def test_rechunker_matches_reference_for_any_arrival_pattern():
    full = torch.arange(23 * 2).reshape(23, 2)
    for chunk, left in [(1, 0), (3, 1), (4, 2), (5, 0), (23, 3), (30, 1)]:
        for pieces in ([23], [1] * 23, [4, 4, 4, 4, 4, 3], [10, 0, 13], [7, 16]):
            rc = Rechunker(StreamSpec(chunk=chunk, left_context=left))
            got, pos = [], 0
            for n in pieces:
                got += rc.push(full[pos : pos + n], True, False)
                pos += n
            got += rc.push(None, False, True)
            want = reference_chunks(full, chunk, left)
            assert [bool(last) for _, last in got] == [False] * (len(want) - 1) + [True]
            assert len(got) == len(want), (chunk, left, pieces)
            for (g, _), w in zip(got, want):
                assert torch.equal(g, w), (chunk, left, pieces)


def test_rechunker_lists_and_passthrough():
    rc = Rechunker(StreamSpec(chunk=2, left_context=1))
    got = rc.push([1, 2, 3], True, False) + rc.push([4], True, False) + rc.push(None, False, True)
    assert got == [([1, 2], False), ([2, 3, 4], False), ([], True)]
    rc = Rechunker(StreamSpec(chunk=2))  # text deltas go through as produced
    assert rc.push("hello", True, False) + rc.push(" world", True, True) == [("hello", False), (" world", True)]
    rc = Rechunker(StreamSpec(chunk=2))
    assert rc.push({"k": 1}, True, True) == [({"k": 1}, True)]


def test_join_waits_for_every_plain_port_and_buffers_early_chunks():
    asm = InputAssembler({"a": None, "b": None, "s": StreamSpec(chunk=2)})
    meta = RequestMeta({"p": 1}, None)
    assert asm.deliver("r", "s", torch.ones(3, 1), True, False, meta) == []  # streamed before the join
    assert asm.deliver("r", "a", torch.zeros(2, 1), True, False, None) == []
    assert asm.deliver("r", "a", torch.ones(1, 1), True, True, None) == []
    actions = asm.deliver("r", "b", "text", True, True, None)
    kinds = [a[0] for a in actions]
    assert kinds == ["add", "feed"]
    req = actions[0][1]
    assert req.params == {"p": 1}
    assert torch.equal(req.inputs["a"], torch.tensor([[0.0], [0.0], [1.0]]))  # concatenated
    assert req.inputs["b"] == "text"
    assert actions[1][2] == "s" and actions[1][3].shape == (2, 1) and actions[1][4] is False
    tail = asm.deliver("r", "s", None, False, True, None)
    assert [(a[0], a[3].shape[0], a[4]) for a in tail] == [("feed", 1, True)]
    assert asm.num_tracked() == 0
