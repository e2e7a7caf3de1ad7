"""`twinplane serve MODEL_DIR`: an OpenAI-compatible server over the own engine (twinplane.serving), for agents,
evaluation harnesses and a trained model's first users. Binds to 127.0.0.1 unless --host says otherwise."""

from __future__ import annotations

import argparse

from twinplane.errors import InputError
from twinplane.serving.server import build_served


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="twinplane serve", description=__doc__.splitlines()[0])
    p.add_argument("model", help="HF model folder (config.json, safetensors, tokenizer.json, chat template)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require this key on every request (Authorization: Bearer KEY)")
    p.add_argument("--served-model-name", help="the model's name in requests (default: the folder's name)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=0, help="prompt + new tokens (default: the model's, "
                                                                 "at most 8192)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences batched at once")
    p.add_argument("--kv-cache-gb", type=float, default=0.0, help="KV cache size (0: automatic)")
    p.add_argument("--tool-parser", default="auto", help="tool-call format: auto (from the chat template), hermes, "
                                                        "qwen3_coder, llama3_json")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not 0 <= a.port < 65536 or a.max_model_len < 0 or a.max_num_seqs < 1 or a.kv_cache_gb < 0:
        raise InputError("--port must be in 0..65535, --max-model-len and --kv-cache-gb >= 0, --max-num-seqs >= 1")
    served = build_served(a.model, a.served_model_name, a.device, a.dtype, a.max_model_len, a.max_num_seqs,
                          a.kv_cache_gb, a.tool_parser, a.api_key, a.seed)
    import uvicorn

    from twinplane.serving.server import build_app

    print(f"twinplane serve: {served.model_name} on http://{a.host}:{a.port}/v1"
          + ("" if served.template else " (no chat template: completions only)"), flush=True)
    try:
        uvicorn.run(build_app(served), host=a.host, port=a.port, log_level="warning")
    finally:
        served.loop.close()
    return 0
