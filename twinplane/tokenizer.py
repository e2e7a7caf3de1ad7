"""Tokenizers: any HF `tokenizer.json` model folder, plus the character-level tokenizer the demo builds.

Both are Hugging Face `tokenizers` objects underneath, saved in HF format so transformers loads them too.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from twinplane.errors import first_line


def _token_text(tok) -> str | None:
    if tok is None or isinstance(tok, str):
        return tok
    return tok.get("content")  # AddedToken serialised as a dict


class Tokenizer:
    """Thin wrapper: encode/decode plus the special-token ids the engine and controller need."""

    def __init__(self, tok: HFTokenizer, config: dict | None = None):
        self.tok = tok
        self.config = config or {}
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.pad_token = _token_text(self.config.get("pad_token"))
        self.eos_token_id = self.token_id(self.eos_token)
        self.bos_token_id = self.token_id(self.bos_token)
        pad = self.token_id(self.pad_token)
        self.pad_token_id = pad if pad is not None else self.eos_token_id

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def vocab_mismatch(self, vocab_size: int) -> str | None:
        """Why a model with `vocab_size` embedding rows cannot take this tokenizer's ids (None when it can). A model
        may have more rows than tokens (Qwen2.5 pads 151,665 tokens to 151,936), never fewer: a tokenizer from
        another model would fail inside the first forward."""
        top = max(self.tok.get_vocab(with_added_tokens=True).values(), default=-1)  # (ids need not be dense)
        if top < vocab_size:
            return None
        return (f"tokenizer.json has token ids up to {top} but config.json's vocab_size is {vocab_size} (is the "
                "tokenizer from another model?)")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        try:
            return self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as e:  # (tokenizers raises a bare Exception for text its vocabulary has no token for)
            raise ValueError(self._cannot_encode(text, e)) from None

    def _cannot_encode(self, text: str, error: Exception) -> str:
        """Which piece of `text` has no token, for a vocabulary without an unknown token (the char tokenizer's)."""
        vocab = self.tok.get_vocab(with_added_tokens=True)
        pieces = self.tok.pre_tokenizer.pre_tokenize_str(text) if self.tok.pre_tokenizer else []
        for piece, (start, _) in pieces:
            if piece not in vocab:
                known = "".join(sorted(t for t in vocab if len(t) == 1))
                return (f"the tokenizer has no token for {piece!r} (character {start} of the text) and no unknown "
                        f"token" + (f"; it knows the characters {known!r}" if known else ""))
        return f"the tokenizer cannot encode the text ({first_line(error)})"

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, batch, skip_special_tokens: bool = True) -> list[str]:
        return self.tok.decode_batch([list(ids) for ids in batch], skip_special_tokens=skip_special_tokens)

    def save(self, out: str | Path) -> None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2))


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load `tokenizer.json` and the special tokens named in `tokenizer_config.json` from a model folder."""
    path = Path(path)
    tj = path / "tokenizer.json"
    if not tj.exists():
        raise FileNotFoundError(f"{path}: no tokenizer.json (only fast HF tokenizers are supported)")
    cfg_file = path / "tokenizer_config.json"
    config = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    tok = HFTokenizer.from_file(str(tj))
    if "eos_token" not in config and (path / "config.json").exists():
        # fall back to the model config's eos id when the tokenizer config names none
        eos_id = json.loads((path / "config.json").read_text()).get("eos_token_id")
        eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
        if eos_id is not None:
            config["eos_token"] = tok.id_to_token(eos_id)
    return Tokenizer(tok, config)


def build_char_tokenizer(alphabet: str, pad: str = "<pad>", eos: str = "<eos>", bos: str = "<bos>") -> Tokenizer:
    """One token per character of `alphabet` (ids after the specials, in order); unknown characters are an error
    at encode time rather than silently mapped."""
    specials = [pad, bos, eos]
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tok = HFTokenizer(models.WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # "." skips newlines
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": pad,
        "bos_token": bos,
        "eos_token": eos,
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
    }
    return Tokenizer(tok, config)
