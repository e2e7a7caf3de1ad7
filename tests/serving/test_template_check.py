"""The append-only check: Qwen2.5's template passes, Qwen3's breaks where it strips earlier reasoning, and
`twinplane doctor --template DIR` reports it with exit codes 0, 1 and 2."""

import json
import string
from pathlib import Path

from template_texts import LLAMA31, QWEN3, QWEN3_CODER, QWEN25
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from twinplane import cli
from twinplane.serving.template_check import SCRIPT, TOOLS, check_template, tokens_join
from twinplane.serving.templates import ChatTemplate
from twinplane.tokenizer import Tokenizer, build_char_tokenizer, load_tokenizer

SPECIALS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]


def model_dir(path: Path, template: str, eos: str = "<|im_end|>") -> Path:
    """A tiny model folder: a character tokenizer with the chat specials as added tokens, and the template."""
    tok = build_char_tokenizer(string.printable)
    tok.tok.add_special_tokens(SPECIALS + [eos])
    tok.save(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template, "eos_token": eos}))
    return path


def check(tmp_path, template, eos="<|im_end|>"):
    folder = model_dir(tmp_path / "m", template, eos)
    return check_template(ChatTemplate.from_model_dir(folder), load_tokenizer(folder))


def test_qwen25_is_append_only(tmp_path):
    report = check(tmp_path, QWEN25)
    assert report.ok and [t.turn for t in report.turns] == [2, 4, 6, 8]
    assert report.tool_parser == "hermes" and all(t.tokens_join for t in report.turns)
    assert any("JSON string render as a quoted string" in n for n in report.notes)  # `arguments | tojson`
    assert "verdict   append-only" in report.format()


def test_qwen3_breaks_where_it_strips_reasoning(tmp_path):
    report = check(tmp_path, QWEN3)
    assert not report.ok and report.notes == []
    first, answer, second, last = report.turns
    assert (second.ok, last.ok) == (True, True)  # after the last user message reasoning is kept
    prompt = ChatTemplate(QWEN3).render(SCRIPT[:2], TOOLS)  # ends "<|im_start|>assistant\n"
    for turn in (first, answer):
        # both break in the first request after the next user message (message 5), in message 2's reasoning: its
        # rendering there starts "<tool_call>" instead of "<think>" (the texts part after the shared "<t")
        assert (turn.ok, turn.request, turn.message, turn.offset) == (False, 6, 2, len(prompt) + 2)
        assert turn.reason.startswith("earlier reasoning (<think>) is stripped")
        assert turn.expected.startswith("_start|>assistant\n<think>\nLook it up.\n</think>\n\n<tool_call>")
        assert turn.rendered.startswith("_start|>assistant\n<tool_call>\n{") and "<think>" not in turn.rendered
    text = report.format()
    assert "NOT append-only" in text and "turn 2    BREAKS in the prompt for 6 messages, inside message 2" in text


def test_other_templates(tmp_path):
    llama = check(tmp_path / "l", LLAMA31, "<|eot_id|>")
    assert llama.tool_parser == "llama3_json" and llama.ok
    coder = check(tmp_path / "c", QWEN3_CODER)
    assert coder.tool_parser == "qwen3_coder" and coder.ok
    assert any("fail to render" in n for n in coder.notes)  # `arguments|items` needs an object


def test_a_rewriting_template_is_caught(tmp_path):
    """A template that numbers turns from the end changes every earlier turn's text."""
    counting = ("{% for m in messages %}<{{ messages|length - loop.index0 }}|{{ m.role }}>{{ m.content or '' }}"
                "{% endfor %}{% if add_generation_prompt %}<0|assistant>{% endif %}")
    report = check(tmp_path, counting)
    assert not report.ok and report.tool_parser is None
    first = report.turns[0]  # "<1|user>...<0|assistant>" becomes "<2|user>...<1|assistant>..."
    assert (first.message, first.offset, first.request) == (0, 1, None) and "generation prompt" in first.reason
    assert "no known tool-call format" in report.format()


def test_tokens_join_is_informational():
    vocab = {"[UNK]": 0, "Hello": 1}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = Tokenizer(tok)
    assert not tokens_join(words, "Hel", "lo") and tokens_join(words, "Hello ", "Hello")


def test_doctor_template_exit_codes(tmp_path, capsys):
    assert cli.main(["doctor", "--template", str(model_dir(tmp_path / "q25", QWEN25))]) == 0
    assert "append-only" in capsys.readouterr().out
    assert cli.main(["doctor", "--template", str(model_dir(tmp_path / "q3", QWEN3)), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["append_only"] is False and out["turns"][0]["request"] == 6
    assert cli.main(["doctor", "--template", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such model folder" in err
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "tokenizer_config.json").write_text("{}")
    assert cli.main(["doctor", "--template", str(tmp_path / "bare")]) == 2
    assert "no chat template" in capsys.readouterr().err
    (tmp_path / "bare" / "chat_template.jinja").write_text(QWEN25)
    assert cli.main(["doctor", "--template", str(tmp_path / "bare")]) == 2
    assert capsys.readouterr().err == f"twinplane: error: {tmp_path / 'bare'}: no tokenizer.json (only fast HF " \
        "tokenizers are supported)\n"
    (tmp_path / "bare" / "tokenizer.json").write_text("{")
    assert cli.main(["doctor", "--template", str(tmp_path / "bare")]) == 2
    assert "tokenizer.json does not load" in capsys.readouterr().err
