"""A tiny random chat model folder for the server's tests: a character tokenizer with ChatML's special tokens, the
Qwen2.5 chat template (tools section, `<tool_call>` JSON), and twinplane's decoder saved as a HF folder."""

from __future__ import annotations

import concurrent.futures
import json
import string
from contextlib import contextmanager
from pathlib import Path

import torch
from template_texts import QWEN25

from twinplane.model import ModelConfig, Transformer
from twinplane.model.weights import save_pretrained
from twinplane.rollout.sequence import Sample
from twinplane.serving.server import BackgroundServer, build_app, build_served
from twinplane.tokenizer import build_char_tokenizer, load_tokenizer

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def chat_model_dir(out: Path, seed: int = 0, max_len: int = 2048) -> Path:
    tok = build_char_tokenizer(string.printable)
    tok.tok.add_special_tokens(SPECIALS)
    tok.tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.config |= {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": QWEN25}
    tok.save(out)
    vocab = tok.vocab_size
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=2,
                                    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=max_len))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.2)
    save_pretrained(model, out)
    assert load_tokenizer(out).eos_token_id == tok.token_id("<|im_end|>")
    json.loads((out / "config.json").read_text())
    return out


@contextmanager
def serving(folder: Path, **kw):
    """(served, url) of a real uvicorn server over `build_served(folder, **kw)`, stopped afterwards."""
    served = build_served(str(folder), **kw)
    server = BackgroundServer(build_app(served))
    try:
        yield served, server.start()
    finally:
        server.stop()
        served.loop.close()


def record_calls(loop) -> list:
    """Every request `loop` (an EngineLoop) takes from now on, as (prompt ids, future of its samples); `del
    loop.submit` stops recording."""
    calls, submit = [], loop.submit

    def spy(ids, sampling, seed, on_tokens=None, key=None):
        fut = submit(ids, sampling, seed, on_tokens, key)
        calls.append((list(ids), fut))
        return fut

    loop.submit = spy
    return calls


class Scripted:
    """Stands in for the engine: answers the calls with the given texts in turn (then the end-of-turn token); keeps
    each call's prompt ids and output ids."""

    def __init__(self, served, texts):
        self.max_model_len, self.served, self.texts, self.prompts = 1024, served, list(texts), []

    def submit(self, ids, sp, seed, on_tokens=None, key=None):
        out = self.served.tokenizer.encode(self.texts.pop(0)) + [self.served.tokenizer.eos_token_id]
        self.prompts.append((list(ids), out))
        f = concurrent.futures.Future()
        f.set_result([Sample(0, list(ids), out, [-0.5] * len(out), "stop", 0)])
        return f
