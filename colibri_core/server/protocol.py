"""uvicorn, hardened: a deadline for a request's headers, and streams that end cleanly
when the shutdown grace period is over.

uvicorn closes a keep-alive connection that stays idle after an answer, but waits
forever for the headers of a request that has started to arrive (or for the first byte
of a new connection): a client that sends its headers a byte at a time ("slowloris")
holds a connection and its buffers for as long as it likes. Here the headers must be
complete within `header_timeout_s` of the connection (or of a next request's first
byte); past it the connection is closed. The body has its own deadlines (limits.py).
"""
from __future__ import annotations

import asyncio
from typing import Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import HEADER_TIMEOUT_S


class HeaderDeadlineProtocol(H11Protocol):
    header_timeout_s: float = HEADER_TIMEOUT_S

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._headers_due: Optional[asyncio.TimerHandle] = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:     # still waiting for a request's headers
            if self._headers_due is None:
                self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._headers_due = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def _headers_late(self) -> None:
        self._headers_due = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def with_header_timeout(seconds: float) -> type:
    """The protocol class uvicorn instantiates per connection, with this deadline."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,),
                {"header_timeout_s": float(seconds)})


class GracefulServer(uvicorn.Server):
    """uvicorn's server, which at the end of the grace period (the app's
    shutdown_timeout_s) cancels the requests still in flight itself: each stream then
    ends with an error event and `data: [DONE]` (and a waiting request with a 503),
    where uvicorn's own deadline, set a few seconds later, would cut them mid-way."""

    def __init__(self, config, server):
        super().__init__(config)
        self.app_server = server

    async def shutdown(self, sockets=None):
        grace = self.app_server.settings.shutdown_timeout_s
        timer = asyncio.get_running_loop().call_later(
            grace, self.app_server.backend.cancel_all)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()
