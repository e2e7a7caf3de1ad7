"""Serving through the OpenAI-compatible endpoint vs one batched `generate` call, same engine, prompts and lengths.

The work: a random Llama-shaped model (4 layers x 256 hidden, GQA 8/4 heads of 32, ffn 768, fp32) with a character
tokenizer and the Qwen2.5 ChatML template; 128 chats (a system and a user message, ~150 tokens rendered), each
answered with exactly `--tokens` new tokens (no stop token: both sides do the same work). Side by side, run after
run:

- batched: the rendered prompts as one `engine.generate` call (128 requests, n=1);
- endpoint: 128 concurrent `chat.completions.create` calls of the official `openai` client (AsyncOpenAI), each
  in its own session (`/sessions/<id>/v1`: the server renders, tokenizes, records the tokens), against uvicorn on
  127.0.0.1; the requests join the engine's batch as they arrive.

Reported: median over `--runs` of generated tokens/s for each, their ratio, and the endpoint's per-request latency
(p50, p99). Appends one row to benchmarks/results/serve_throughput.csv.

    python benchmarks/serve_throughput.py --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime
import statistics
import string
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from twinplane.model import ModelConfig, Transformer  # noqa: E402
from twinplane.rollout import RolloutEngine, SamplingParams  # noqa: E402
from twinplane.serving.engine_loop import EngineLoop  # noqa: E402
from twinplane.serving.openai_api import Served
from twinplane.serving.server import (
    BackgroundServer,  # noqa: E402
    build_app,  # noqa: E402
)
from twinplane.serving.sessions import Session, SessionStore  # noqa: E402
from twinplane.serving.templates import ChatTemplate  # noqa: E402
from twinplane.tokenizer import build_char_tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "serving"))
from template_texts import QWEN25  # noqa: E402

CHATS = 128


def setup(tokens: int):
    tok = build_char_tokenizer(string.printable)
    tok.tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.config["eos_token"] = "<|im_end|>"
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, hidden_size=256, intermediate_size=768, num_layers=4,
                                    num_heads=8, num_kv_heads=4, head_dim=32, max_position_embeddings=1024))
    engine = RolloutEngine(model, eos_token_id=None, max_num_seqs=CHATS)  # (no stop: every answer is `tokens` long)
    template = ChatTemplate(QWEN25, {"eos_token": "<|im_end|>"})
    chats = [[{"role": "system", "content": "You are a careful assistant."},
              {"role": "user", "content": f"Question {i}: what is {i} + {2 * i}? Show your work."}]
             for i in range(CHATS)]
    served = Served(EngineLoop(engine, 1024), tok, "bench", template, sessions=SessionStore(),
                    session_sampling=SamplingParams(temperature=1.0, max_new_tokens=tokens))
    return engine, tok, template, chats, served


def batched(engine, tok, template, chats, tokens: int) -> float:
    prompts = [tok.encode(template.render(c, add_generation_prompt=True)) for c in chats]
    t0 = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=1))
    return sum(len(s.token_ids) for s in out) / (time.perf_counter() - t0)


def endpoint(served, url: str, chats, tokens: int, run: int) -> tuple[float, list[float]]:
    from openai import AsyncOpenAI

    for i in range(CHATS):
        served.sessions.open(Session(f"r{run}-{i}", served.tokenizer, seed=i))

    async def all_chats():
        async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600) as base:
            async def one(i):
                t0 = time.perf_counter()
                client = base.with_options(base_url=f"{url}/sessions/r{run}-{i}/v1")
                r = await client.chat.completions.create(model="bench", messages=chats[i], max_tokens=tokens)
                return r.usage.completion_tokens, time.perf_counter() - t0

            return await asyncio.gather(*[one(i) for i in range(CHATS)])

    t0 = time.perf_counter()
    done = asyncio.run(all_chats())
    wall = time.perf_counter() - t0
    for i in range(CHATS):
        served.sessions.close(f"r{run}-{i}")
    return sum(n for n, _ in done) / wall, [s for _, s in done]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", default="benchmarks/results/serve_throughput.csv")
    a = p.parse_args()
    engine, tok, template, chats, served = setup(a.tokens)
    server = BackgroundServer(build_app(served))
    url = server.start()
    endpoint(served, url, chats, 4, -1)  # (warm-up: the pool, the client's connections)
    served.loop.shut()
    rows = []
    for run in range(a.runs):
        b = batched(engine, tok, template, chats, a.tokens)
        served.loop.open()
        e, latencies = endpoint(served, url, chats, a.tokens, run)
        served.loop.shut()
        lat = sorted(latencies)
        rows.append((b, e, lat[len(lat) // 2], lat[min(len(lat) - 1, int(0.99 * len(lat)))]))
        print(f"run {run}: batched {b:.0f} tok/s, endpoint {e:.0f} tok/s ({e / b:.2f}x), "
              f"latency p50 {rows[-1][2]:.2f} s p99 {rows[-1][3]:.2f} s", flush=True)
    server.stop()
    served.loop.close()
    b, e = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
    p50, p99 = statistics.median(r[2] for r in rows), statistics.median(r[3] for r in rows)
    print(f"median of {a.runs}: batched {b:.0f} tok/s, endpoint {e:.0f} tok/s, ratio {e / b:.2f}x, "
          f"latency p50 {p50:.2f} s, p99 {p99:.2f} s")
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = Path(a.out)
    new = not out.exists()
    with out.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["date", "commit", "torch", "threads", "chats", "tokens", "runs", "batched_tok_s",
                        "endpoint_tok_s", "ratio", "p50_s", "p99_s"])
        w.writerow([datetime.date.today().isoformat(), sha, torch.__version__, torch.get_num_threads(), CHATS,
                    a.tokens, a.runs, f"{b:.0f}", f"{e:.0f}", f"{e / b:.3f}", f"{p50:.3f}", f"{p99:.3f}"])


if __name__ == "__main__":
    main()
