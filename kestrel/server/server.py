"""uvicorn, taught three things: SIGTERM aborts in-flight requests (so shutdown takes seconds, not as long as the
longest generation), a failed engine startup stops the server with a non-zero exit, and the server says it is
serving only once the model is ready (uvicorn's "Uvicorn running on" would claim it while weights still load)."""
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
        self.url: str | None = None     # http://host:port, once listening
        self._announced_ready = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.url is None and self.servers and self.servers[0].sockets:   # sockets given: no started message
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.url = f"http://{host}:{port}"

    def _log_started_message(self, listeners) -> None:
        """Replaces uvicorn's "Uvicorn running on ...": the port is open but the model is still loading."""
        host, port = listeners[0].getsockname()[:2] if listeners else (self.config.host, self.config.port)
        self.url = f"http://[{host}]:{port}" if ":" in str(host) else f"http://{host}:{port}"
        logger.info("listening on %s while the model loads (GET /health reports the startup phase)", self.url)

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

    @property
    def startup_error(self) -> BaseException | None:
        return self.state.engine.startup_error

    async def on_tick(self, counter: int) -> bool:
        engine = self.state.engine
        if engine.startup_error is not None and not self.startup_failed:
            self.startup_failed = True
            # The reason is said once, by whoever runs the server (`kestrel serve` prints it as its last line)
            logger.info("shutting down: the engine did not start")
            self.should_exit = True
        elif engine.ready and not self._announced_ready:
            self._announced_ready = True
            logger.info("ready: serving %s on %s (max_model_len %d); OpenAI API at %s/v1, docs at %s/docs",
                        self.state.model_name, self.url, engine.max_model_len, self.url, self.url)
        return await super().on_tick(counter)
