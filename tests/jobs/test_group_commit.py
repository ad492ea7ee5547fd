"""GroupCommitter: submissions that arrive together share one write, each caller gets its own
result only after that write, and an inline committer writes on the event loop's thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from omnistage.serving.jobs.group_commit import GroupCommitter


@pytest.mark.parametrize("inline", [False, True])
def test_concurrent_submissions_share_a_write(inline):
    batches: list[tuple[list[int], int]] = []

    def write(items: list[int]) -> list[int]:
        batches.append((list(items), threading.get_ident()))
        return [i * 10 for i in items]

    async def main():
        committer = GroupCommitter(write, inline=inline)
        runner = asyncio.create_task(committer.run())
        results = await asyncio.gather(*(committer.submit(i) for i in range(20)))
        await committer.idle.wait()
        runner.cancel()
        return results

    loop_thread = threading.get_ident()
    assert asyncio.run(main()) == [i * 10 for i in range(20)]
    assert sorted(i for items, _ in batches for i in items) == list(range(20))
    assert len(batches) < 20  # grouped, not one write per submission
    threads = {t for _, t in batches}
    assert threads == {loop_thread} if inline else loop_thread not in threads


def test_a_failed_write_fails_its_callers_and_the_next_batch_still_runs():
    calls = []

    def write(items: list[str]) -> list[str]:
        calls.append(items)
        if "bad" in items:
            raise RuntimeError("disk full")
        return items

    async def main():
        committer = GroupCommitter(write, inline=True)
        runner = asyncio.create_task(committer.run())
        with pytest.raises(RuntimeError, match="disk full"):
            await committer.submit("bad")
        assert await committer.submit("good") == "good"
        runner.cancel()

    asyncio.run(main())
    assert calls == [["bad"], ["good"]]
