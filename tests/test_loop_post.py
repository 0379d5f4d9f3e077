"""engine_async.LoopPost: a step's updates for one event loop cross in one wake-up, in order."""
from __future__ import annotations

import asyncio
import threading

from nbgen.engine_async import LoopPost, loop_post


def test_one_wakeup_carries_a_burst_in_order_per_queue() -> None:
    async def main() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        calls = 0
        real = loop.call_soon_threadsafe

        def counted(*args):
            nonlocal calls
            calls += 1
            return real(*args)
        loop.call_soon_threadsafe = counted
        post = LoopPost(loop)
        queues = [asyncio.Queue() for _ in range(4)]
        got = [[] for _ in queues]
        for step in range(2):            # the loop thread's steps; the event loop waits meanwhile
            t = threading.Thread(target=lambda: [post.put(queues[i % 4], step * 100 + i) for i in range(100)])
            t.start()
            t.join()
            for qi, q in enumerate(queues):
                for _ in range(25):
                    got[qi].append(await q.get())
        return got, calls
    got, calls = asyncio.run(main())
    assert got == [[s * 100 + i for s in range(2) for i in range(100) if i % 4 == qi] for qi in range(4)]
    assert calls == 2                    # one wake-up per step's burst of 100 updates


def test_a_closed_loop_drops_updates_and_each_loop_has_one_post() -> None:
    loop = asyncio.new_event_loop()
    post = loop_post(loop)
    assert loop_post(loop) is post
    loop.close()
    post.put(asyncio.Queue(), 1)         # no error: nobody is listening any more
    post.put(asyncio.Queue(), 2)
    other = asyncio.new_event_loop()
    assert loop_post(other) is not post
    other.close()
