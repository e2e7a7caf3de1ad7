"""Run the API with uvicorn: in the foreground (`twinplane serve`) or on a thread of a training run, on a free port
of 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI

from twinplane.data.records import DataError
from twinplane.errors import InputError
from twinplane.model.weights import load_model
from twinplane.platform import runtime
from twinplane.rollout.engine import RolloutEngine
from twinplane.serving import anthropic_api, openai_api, responses_api
from twinplane.serving.engine_loop import EngineLoop
from twinplane.serving.openai_api import Served
from twinplane.serving.sessions import SessionStore
from twinplane.serving.templates import ChatTemplate
from twinplane.tokenizer import load_tokenizer


def build_served(model_dir: str, name: str | None = None, device: str = "auto", dtype: str | None = None,
                 max_model_len: int = 0, max_num_seqs: int = 256, kv_cache_gb: float = 0.0,
                 tool_parser: str = "auto", api_key: str | None = None, seed: int = 0):
    """The engine loop and what the routes need, for a HF model folder."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise InputError(f"{model_dir}: not a model folder (no config.json)")
    tokenizer = load_tokenizer(path)
    dev = runtime.default_device() if device == "auto" else torch.device(device)
    model = load_model(path, dev, dtype or ("float32" if dev.type == "cpu" else "bfloat16"))
    try:
        template = ChatTemplate.from_model_dir(path)
    except DataError:
        template = None  # a base model: completions only
    context = model.config.max_position_embeddings
    if max_model_len > context:
        raise InputError(f"--max-model-len {max_model_len}: the model's context is {context} tokens")
    engine = RolloutEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id or 0, max_num_seqs=max_num_seqs,
                           seed=seed, kv_cache_bytes=int(kv_cache_gb * 2**30))
    loop = EngineLoop(engine, max_model_len or min(context, 8192))
    return Served(loop, tokenizer, name or path.resolve().name, template, tool_parser, api_key, SessionStore(),
                  seed=seed)



def build_app(served: Served) -> FastAPI:
    """The server's app: OpenAI's routes, Anthropic's `/messages` and OpenAI's `/responses`, over `served`."""
    app = FastAPI(title="twinplane", docs_url=None, redoc_url=None)
    app.state.served = served
    for routes in (openai_api, anthropic_api, responses_api):
        routes.register(app, served)
    return app


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
