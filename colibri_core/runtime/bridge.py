"""The one bridge from threads to an event loop: a LoopQueue.

Any thread `put`s; the loop `await get()`s. A stream's token events go straight from the
scheduler's thread into the reader's loop (`Generation`'s `async for`, the server's
calls), one `call_soon_threadsafe` each: no thread of their own in between. An item may
carry an `ack`, run on the loop when the item is taken (the scheduler's flow control: a
stream runs at most a few tokens ahead of its reader).
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Callable, Optional

DONE = object()          # a request's end (put by the scheduler once it is done)


class LoopQueue:
    """Items from any thread to one event loop (create it on the loop's thread)."""

    def __init__(self, loop: Optional[asyncio.AbstractEventLoop] = None):
        self.loop = loop or asyncio.get_running_loop()
        self._items: deque = deque()
        self._waiter: Optional[asyncio.Future] = None

    # -- any thread -------------------------------------------------------------------
    def put(self, item: Any, ack: Optional[Callable[[], None]] = None) -> None:
        """Hand `item` to the loop; nothing when the loop is gone (nobody listens)."""
        try:
            self.loop.call_soon_threadsafe(self._arrive, item, ack)
        except RuntimeError:
            pass

    # -- the loop -----------------------------------------------------------------------
    def _arrive(self, item, ack) -> None:
        self._items.append((item, ack))
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> Any:
        item, ack = self._items.popleft()
        if ack is not None:
            ack()
        return item

    def unget(self, item: Any) -> None:
        """Put an item back in front (taken again by the next get)."""
        self._items.appendleft((item, None))

    async def get(self) -> Any:
        while not self._items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.get_nowait()
