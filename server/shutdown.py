"""A graceful stop, as Kubernetes and load balancers expect it.

On the first SIGTERM or Ctrl-C the server drains (`ServerState.drain`): /ready turns 503 at once while /health stays
200, a new request gets 503 with Retry-After, and the requests in flight run on for up to --shutdown-timeout-s; any
still running then end with an error (a stream's error event and `[DONE]`, a 503 otherwise). Only then does uvicorn
close the listening socket and the connections, and the process exits 0. A second signal ends it at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger(__name__)


class GracefulServer(uvicorn.Server):
    """uvicorn's server, but its first signal drains the app before uvicorn's own shutdown begins."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, timeout_s: float) -> None:
        super().__init__(config)
        self.state = app.state.pagedserve
        self.timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()  # before uvicorn installs its signal handlers
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: it only hands the work to the event loop. The first signal is not recorded for uvicorn
        # to raise again on its way out, so a drained server exits 0; a second one is, and ends the process at once.
        if self._drain is not None or self.should_exit or self._loop is None:
            logger.warning("second %s: stopping now", signal.Signals(sig).name)
            super().handle_exit(sig, frame)
            self.force_exit = True
            return
        logger.info("%s: draining (up to %g s; send it again to stop now)", signal.Signals(sig).name, self.timeout_s)
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.state.drain(self.timeout_s)
        finally:
            self.should_exit = True
