import pytest

from twinplane import build_char_tokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")


def test_char_tokenizer_roundtrip_and_transformers(tmp_path):
    tok = build_char_tokenizer("0123456789+=")
    ids = tok.encode("47+85=")
    assert len(ids) == 6 and tok.decode(ids + [tok.eos_token_id]) == "47+85="
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf("47+85=", add_special_tokens=False).input_ids == ids
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id) == (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id)
    again = load_tokenizer(tmp_path)
    assert again.encode("47+85=") == ids and again.eos_token_id == tok.eos_token_id
    for t in (tok, again):  # unknown characters are a one-line error naming the character, not silently mapped
        with pytest.raises(ValueError, match=r"^the tokenizer has no token for 'x' \(character 3 of the text\) and no "
                                             r"unknown token; it knows the characters '\+0123456789='$"):
            t.encode("47+x")


def test_load_hf_tokenizer_folder(tmp_path):
    """A tokenizer written by transformers (special tokens in tokenizer_config.json) loads with its ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>")
    hf.save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.encode("hello world") == [2, 3] and tok.eos_token_id == 1 and tok.pad_token_id == 1
