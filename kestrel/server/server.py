"""uvicorn, taught two things: SIGTERM aborts in-flight requests (so shutdown takes seconds, not as long as the
longest generation), and a failed engine startup stops the server with a non-zero exit."""
from __future__ import annotations

import asyncio
import logging

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger("kestrel.server")


class KestrelServer(uvicorn.Server):
    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                 graceful_timeout_s: float = 5.0) -> None:
        # timeout_graceful_shutdown: a connection that ignores the abort is cut after this long
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                        timeout_graceful_shutdown=graceful_timeout_s, lifespan="on"))
        self.state = app.state.kestrel
        self.startup_failed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        # Runs in a signal handler: schedule the abort on the loop instead of touching asyncio state here.
        if not self.should_exit and self._loop is not None:
            logger.info("signal %s: refusing new requests and aborting %d in flight", sig,
                        self.state.engine.num_in_flight())
            self._loop.call_soon_threadsafe(self.state.engine.begin_shutdown)
        super().handle_exit(sig, frame)

    def request_exit(self) -> None:
        """Stop from another thread (tests) the way SIGTERM would."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.state.engine.begin_shutdown)
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.state.engine.startup_error is not None and not self.startup_failed:
            self.startup_failed = True
            logger.info("shutting down: the engine did not start")   # the engine front logged why
            self.should_exit = True
        return await super().on_tick(counter)
