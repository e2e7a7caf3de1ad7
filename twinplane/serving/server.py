"""Run the API with uvicorn: in the foreground (`twinplane serve`) or on a thread of a training run, on a free port
of 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI


class BackgroundServer:
    """uvicorn on its own thread (with its own event loop); `url` once started. `port=0`: a free one."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="twinplane-server", daemon=True)
        self.host = host

    def start(self, timeout_s: float = 30.0) -> str:
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"the API server did not start on {self.host}")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        return self.url

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
