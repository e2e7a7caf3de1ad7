"""Prompt data: loaders agree across formats, bad input fails with file:line, the stream resumes exactly, and
chat formatting matches transformers' `apply_chat_template` text for the same template."""

import json
from pathlib import Path

import pytest
from conftest import data_path

from twinplane.data import DataError, PromptFormatter, PromptStream, Record, filter_by_length, load_records

GSM8K_ROWS = [  # GSM8K's original format: the answer is a worked solution ending in "#### N"
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
     "answer": "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7", "level": 1, "source": "fixture"},
    {"question": "A pen costs $2. How much do 5 pens cost?",
     "answer": "5 pens cost 5 * 2 = <<5*2=10>>10 dollars.\n#### 10", "level": 1, "source": "fixture"},
    {"question": "Ana read 12 pages on Monday and half as many on Tuesday. How many pages in all? ¿Ünïcode?",
     "answer": "Tuesday: 12 / 2 = <<12/2=6>>6.\nIn all 12 + 6 = <<12+6=18>>18.\n#### 18", "level": 2,
     "source": "fixture"},
]
SHARED_GSM8K = data_path("gsm8k")


def write_jsonl(path: Path, rows, raw_lines=()) -> Path:
    lines = [json.dumps(r, ensure_ascii=False) for r in rows] + list(raw_lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def expected_records() -> list[Record]:
    return [Record(r["question"], r["answer"]) for r in GSM8K_ROWS]


# ---- loaders -----------------------------------------------------------------------------------------------


def test_jsonl_parquet_and_saved_dataset_give_identical_records(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    jsonl = write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), tmp_path / "train.parquet")
    datasets.Dataset.from_list(GSM8K_ROWS).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K_ROWS)}).save_to_disk(str(tmp_path / "dict"))

    want = expected_records()
    for source, kw in [(jsonl, {}), (tmp_path / "train.parquet", {}), (tmp_path / "saved", {}),
                       (tmp_path / "dict", {"split": "train"}), (tmp_path / "dict" / "train", {})]:
        records, stats = load_records(source, **kw)
        assert records == want, source
        assert stats["loaded"] == 3 and stats["skipped"] == 0

    with pytest.raises(DataError, match=r"DatasetDict folder with splits train; pass split=") as e:
        load_records(tmp_path / "dict")
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"no split 'test' \(splits: train\)"):
        load_records(tmp_path / "dict", split="test")


def test_custom_fields_system_and_meta(tmp_path):
    rows = [{"problem": "2+2?", "solution": 4, "sys": "Be brief.", "level": 3, "id": "a"},
            {"problem": "3+5?", "solution": "8", "sys": None, "level": 1, "id": "b"}]
    path = write_jsonl(tmp_path / "math.jsonl", rows)
    records, _ = load_records(path, prompt_field="problem", answer_field="solution", system_field="sys",
                              meta_fields=("level", "id"))
    assert records == [Record("2+2?", "4", "Be brief.", {"level": 3, "id": "a"}),
                       Record("3+5?", "8", None, {"level": 1, "id": "b"})]


def test_chat_message_prompts_and_json_array(tmp_path):
    msgs = [{"role": "user", "content": "What is 6*7?"}]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([{"messages": msgs, "answer": 42}]))
    records, _ = load_records(path, prompt_field="messages")
    assert records == [Record(msgs, "42")]


def test_gsm8k_defaults_need_no_options(tmp_path):
    records, stats = load_records(write_jsonl(tmp_path / "gsm.jsonl", GSM8K_ROWS))
    assert stats["loaded"] == 3 and all(r.answer.rsplit("####", 1)[1].strip().isdigit() for r in records)


# ---- bad input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad_line, message", [
    ('{"question": "q", "answer": ', r"bad\.jsonl:3: invalid JSON \(Expecting value at column 29\)"),
    ('["not", "an", "object"]', r"bad\.jsonl:3: expected a JSON object, got list"),
    ('{"question": 5, "answer": "1"}', r"bad\.jsonl:3: field 'question' must be a string or a message list, got int"),
    ('{"question": "q", "answer": null}', r"bad\.jsonl:3: field 'answer' must be a string or a number, got null"),
    ('{"question": "q", "answer": [1]}', r"bad\.jsonl:3: field 'answer' must be a string or a number, got list"),
    ('{"question": "q"}', r"bad\.jsonl:3: missing field 'answer' \(fields: question\)"),
    ('{"question": "  ", "answer": "1"}', r"bad\.jsonl:3: field 'question' is empty"),
    ('{"question": [{"role": "user"}], "answer": "1"}', r"bad\.jsonl:3: a chat prompt must be a list of"),
])
def test_malformed_row_fails_with_file_and_line_or_is_skipped(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", GSM8K_ROWS[:2], raw_lines=[bad_line, json.dumps(GSM8K_ROWS[2])])
    with pytest.raises(DataError, match=message) as e:
        load_records(path)
    assert "\n" not in str(e.value) and "on_error=skip" in str(e.value)
    records, stats = load_records(path, on_error="skip")
    assert records == expected_records() and stats["loaded"] == 3 and stats["skipped"] == 1
    assert stats["skipped_examples"][0].startswith(f"{path}:3: ")


def test_blank_lines_and_bom_are_ignored(tmp_path):
    path = tmp_path / "blank.jsonl"
    body = "\n".join(json.dumps(r) for r in GSM8K_ROWS)
    path.write_bytes(b"\xef\xbb\xbf" + body.replace("\n", "\n\n  \r\n", 1).encode() + b"\n\n")
    records, stats = load_records(path)
    assert records == expected_records() and stats["skipped"] == 0


def test_unknown_field_name_lists_the_fields(tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", GSM8K_ROWS)
    with pytest.raises(DataError, match=r"gsm\.jsonl:1: no field 'prompt' \(fields: question, answer, level, source\)"):
        load_records(path, prompt_field="prompt")
    with pytest.raises(DataError, match=r"no field 'difficulty' \(fields:"):
        load_records(path, meta_fields=("difficulty",), on_error="skip")  # an option error: never skipped
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), tmp_path / "gsm.parquet")
    with pytest.raises(DataError, match=r"gsm\.parquet: no field 'problem' \(fields: question, answer, level"):
        load_records(tmp_path / "gsm.parquet", prompt_field="problem")


def test_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(GSM8K_ROWS[0]).encode() + b"\n" + '{"question": "caf\xe9", "answer": "1"}'.encode(
        "latin-1") + b"\n")
    for on_error in ("fail", "skip"):
        with pytest.raises(DataError, match=r"latin1\.jsonl:2: invalid UTF-8 at byte 17"):
            load_records(path, on_error=on_error)


def test_empty_missing_and_unknown_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no records \(the dataset is empty\)"):
        load_records(tmp_path / "empty.jsonl")
    write_jsonl(tmp_path / "junk.jsonl", [], raw_lines=["{oops", "[]"])
    with pytest.raises(DataError, match=r"junk\.jsonl: no records \(all 2 rows were malformed, e\.g\. .*junk\.jsonl:1"):
        load_records(tmp_path / "junk.jsonl", on_error="skip")
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file or directory"):
        load_records(tmp_path / "nope.jsonl")
    (tmp_path / "data.csv").write_text("question,answer\n")
    with pytest.raises(DataError, match=r"unknown data format '\.csv'"):
        load_records(tmp_path / "data.csv")
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match=r"not one written by datasets' save_to_disk"):
        load_records(tmp_path / "folder")
    with pytest.raises(DataError, match=r"on_error must be 'fail' or 'skip'"):
        load_records(tmp_path / "empty.jsonl", on_error="ignore")


@pytest.mark.skipif(not (SHARED_GSM8K / "train.jsonl").is_file(), reason="no GSM8K (--data-dir, $TWINPLANE_DATA)")
def test_shared_gsm8k_loads_with_defaults():
    for split, size in (("train", 7473), ("test", 1319)):
        path = SHARED_GSM8K / f"{split}.jsonl"
        records, stats = load_records(path)
        assert len(records) > 1000 and stats["skipped"] == 0
        assert all("####" in r.answer and r.prompt for r in records)
        lines = sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
        assert len(records) == lines
        if lines == size:  # the canonical release; a trimmed copy still passes the checks above
            assert len(records) == size


# ---- stream ------------------------------------------------------------------------------------------------


def test_stream_epochs_cover_every_item_once_and_are_seeded():
    items = list(range(10))
    s = PromptStream(items, seed=3)
    epochs = [s.next_batch(10) for _ in range(3)]
    assert all(sorted(e) == items for e in epochs)
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    assert PromptStream(items, seed=3).next_batch(30) == sum(epochs, [])
    assert PromptStream(items, seed=4).next_batch(10) != epochs[0]
    s2 = PromptStream(items, seed=3)
    crossing = s2.next_batch(7) + s2.next_batch(7)  # batches run across the epoch boundary
    assert crossing == sum(epochs, [])[:14] and s2.state_dict() == {"epoch": 1, "position": 4, "seed": 3, "size": 10}


@pytest.mark.parametrize("consumed", [0, 5, 10, 23])
def test_stream_resume_continues_like_the_uninterrupted_stream(consumed):
    items = [f"p{i}" for i in range(10)]
    reference = PromptStream(items, seed=7)
    reference.next_batch(consumed)
    want = reference.next_batch(25)
    before = PromptStream(items, seed=7)
    before.next_batch(consumed)
    state = json.loads(json.dumps(before.state_dict()))  # survives a JSON checkpoint
    resumed = PromptStream(items, seed=999)  # the saved seed wins
    resumed.load_state_dict(state)
    assert resumed.next_batch(25) == want


def test_stream_rejects_mismatched_state():
    s = PromptStream(list(range(4)), seed=0)
    with pytest.raises(ValueError, match="position 9 is beyond the dataset size 4"):
        s.load_state_dict({"epoch": 0, "position": 9, "seed": 0})
    with pytest.raises(ValueError, match="saved for 5 prompts but the dataset has 4"):
        s.load_state_dict({"epoch": 0, "position": 1, "seed": 0, "size": 5})
    with pytest.raises(ValueError, match="lacks seed"):
        s.load_state_dict({"epoch": 0, "position": 1})
    with pytest.raises(ValueError, match="negative cursor"):
        s.load_state_dict({"epoch": -1, "position": 0, "seed": 0})
    with pytest.raises(ValueError, match="at least one item"):
        PromptStream([], seed=0)


def test_tasks_package_still_exports_prompt_stream():
    from twinplane.data.tasks import PromptStream as FromTasks

    assert FromTasks is PromptStream


# ---- formatting --------------------------------------------------------------------------------------------

CHATML = (  # ChatML in Qwen2.5's shape: a default system prompt, tools rendered with tojson
    "{%- if tools %}{{- '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}\n{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if not (message.role == 'system' and loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)
LLAMA3 = """{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] | trim %}{% set loop_messages = messages[1:] %}
{% else %}
    {% set system = 'Cutting Knowledge Date: ' + strftime_now('%Y') %}{% set loop_messages = messages %}
{% endif %}
{{ bos_token }}<|start_header_id|>system<|end_header_id|>

{{ system }}<|eot_id|>
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'assistant' %}{% generation %}
{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
    {% endgeneration %}{% else %}
{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}
{{ messages[-1]['content'] | tojson }}"""


def make_tokenizer_dir(path: Path, template: str, bos: str, eos: str, in_config: bool = False) -> Path:
    """A tiny word-level tokenizer saved the way real model folders are, with `template` as its chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", bos, eos, "hello", "world"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token="<unk>")
    fast.chat_template = template
    fast.save_pretrained(str(path))
    if in_config:  # the older layout: the template inside tokenizer_config.json, as a list of named templates
        (path / "chat_template.jinja").unlink(missing_ok=True)
        config = json.loads((path / "tokenizer_config.json").read_text())
        config["chat_template"] = [{"name": "default", "template": template}, {"name": "tool_use", "template": "x"}]
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


RECORDS = [
    Record("What is 2 + 3?", "5"),
    Record("  Solve: x * 4 = 12 <b>&</b> ünïcode ", "3", system="You are a careful math tutor."),
    Record([{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "2+2?"}], "4"),
]


@pytest.mark.parametrize("template, bos, eos, in_config", [
    (CHATML, "<|endoftext|>", "<|im_end|>", False),
    (CHATML, "<|endoftext|>", "<|im_end|>", True),
    (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", False),
    (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", True),
])
@pytest.mark.parametrize("system_prompt, suffix", [(None, None), ("Reason step by step.", None),
                                                    (None, "\nGive the final answer after ####."),
                                                    ("Reason step by step.", " Answer after ####.")])
def test_chat_format_matches_transformers(tmp_path, template, bos, eos, in_config, system_prompt, suffix):
    from transformers import AutoTokenizer

    folder = make_tokenizer_dir(tmp_path / "tok", template, bos, eos, in_config)
    formatter = PromptFormatter.from_model_dir(folder, system_prompt=system_prompt, instruction_suffix=suffix)
    reference = AutoTokenizer.from_pretrained(str(folder))
    for record in RECORDS:
        messages = formatter.messages(record)
        want = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert formatter.format(record) == want
        assert want.endswith(("<|im_start|>assistant\n", "<|end_header_id|>\n\n" + json.dumps(
            messages[-1]["content"], ensure_ascii=False)))
    text = formatter.format(RECORDS[1])
    assert "You are a careful math tutor." in text and (suffix or "") in text  # the record's system prompt wins
    if system_prompt:
        assert system_prompt in formatter.format(RECORDS[0])


def test_chat_messages_are_built_as_documented():
    f = PromptFormatter("chat", chat_template=CHATML, system_prompt="S", instruction_suffix=" Go.")
    assert f.messages(RECORDS[0]) == [{"role": "system", "content": "S"},
                                      {"role": "user", "content": "What is 2 + 3? Go."}]
    assert f.messages(RECORDS[2])[0] == {"role": "system", "content": "S"}
    assert f.messages(RECORDS[2])[-1] == {"role": "user", "content": "2+2? Go."}
    assert RECORDS[2].prompt[-1]["content"] == "2+2?"  # the record is not mutated


def test_template_raise_exception_becomes_one_line_error(tmp_path):
    from jinja2.exceptions import TemplateError
    from transformers import AutoTokenizer

    folder = make_tokenizer_dir(tmp_path / "tok", LLAMA3, "<|begin_of_text|>", "<|eot_id|>")
    bad = Record([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "x")
    with pytest.raises(TemplateError, match="roles must alternate"):
        AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(bad.prompt, tokenize=False)
    with pytest.raises(DataError, match=r"^chat template error: Conversation roles must alternate"):
        PromptFormatter.from_model_dir(folder).format(bad)


def test_chat_mode_without_template_and_bad_templates(tmp_path):
    folder = make_tokenizer_dir(tmp_path / "tok", CHATML, "<s>", "</s>")
    (folder / "chat_template.jinja").unlink()
    missing = f"^{folder.absolute()}: no chat template was found .*: use data.template=plain"
    with pytest.raises(DataError, match=missing):
        PromptFormatter.from_model_dir(folder)
    assert PromptFormatter.from_model_dir(folder, mode="plain").format(RECORDS[0]) == "What is 2 + 3?"
    with pytest.raises(DataError, match="chat template syntax error at template line 1"):
        PromptFormatter("chat", chat_template="{% for m in messages %}")
    with pytest.raises(DataError, match="mode must be 'chat' or 'plain'"):
        PromptFormatter("base")


@pytest.mark.parametrize("expr, error", [("'x' * 10**12", "repetition of 1 x 1000000000000 is too large"),
                                         ("[0] * 10**12", "repetition of 1 x 1000000000000 is too large"),
                                         ("9 ** (10**9)", "exponent of 1000000000 is too large"),
                                         ("'{:>99999999999}'.format(1)", "MemoryError|OverflowError|ValueError")])
def test_a_template_cannot_exhaust_memory(expr, error):
    """A downloaded template is code: what would allocate without bound is a one-line error, and small uses work."""
    with pytest.raises(DataError, match=f"^chat template error: .*({error})"):
        PromptFormatter("chat", chat_template="{{ " + expr + " }}").format(RECORDS[0])
    small = PromptFormatter("chat", chat_template="{{ '=' * 3 }}{{ 2 ** 3 }}{{ [1] * 2 }}{{ 3 * 'a' }}")
    assert small.format(RECORDS[0]) == "===8[1, 1]aaa"


def test_plain_template_fields():
    f = PromptFormatter("plain", plain_template="{system}|Question: {raw_prompt}{suffix}\n{prompt}\nAnswer: {{x}}",
                        system_prompt="SYS", instruction_suffix=" (after ####)")
    assert f.format(Record("2+2?", "4")) == "SYS|Question: 2+2? (after ####)\n2+2? (after ####)\nAnswer: {x}"
    assert f.format(Record("2+2?", "4", system="own")).startswith("own|")
    assert PromptFormatter("plain").format(Record("q {x}", "a")) == "q {x}"  # the prompt itself is never parsed
    with pytest.raises(DataError, match=r"plain_template field \{question\} is not one of \{prompt\}"):
        PromptFormatter("plain", plain_template="Q: {question}")
    for sneaky in ("{prompt.__class__}", "{prompt[0]}", "{}"):
        with pytest.raises(DataError, match="plain_template field"):
            PromptFormatter("plain", plain_template=sneaky)
    for sneaky, what in (("{prompt:>99999999999}", "format spec"), ("{prompt:.2}", "format spec"),
                         ("{prompt:{system}}", "format spec"), ("{prompt!r}", "conversion"),
                         ("{prompt!s:>3}", "conversion")):  # checked by parsing: the width is never allocated
        with pytest.raises(DataError, match=f"plain_template field .* has a {what}: fields are substituted as"):
            PromptFormatter("plain", plain_template=sneaky)
    with pytest.raises(DataError, match="data.template=plain needs string prompts"):
        f.format(RECORDS[2])


def test_filter_by_length_drops_and_counts():
    kept, dropped = filter_by_length([[1] * 3, [1] * 5, [], [1] * 6, [1] * 5], max_len=5)
    assert kept == [0, 1, 2, 4] and dropped == 1
    with pytest.raises(ValueError, match="positive"):
        filter_by_length([[1]], 0)
