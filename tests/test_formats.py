"""Data formats: plain, prompt-templated, instruction and chat rows become the tokens and
labels a job trains on; chat through the model's own template, loss on assistant turns."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from plora.data.chat_template import ChatTemplate, load_chat_template
from plora.data.dataset import IGNORE_INDEX, DataError, TextTokenizer, load_split, prepare_data, tokenize_split
from plora.data.formats import INSTRUCTION_TEMPLATE, INSTRUCTION_TEMPLATE_NO_INPUT
from plora.job.config import JobData, JobEval

#: a chat template in the tiny model's alphabet: user turns end with "=", assistant turns with eos
TINY_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
                 "{% else %}{{ m.content }}={% endif %}{% endfor %}")
#: the same with {% generation %} blocks around the assistant turns
TINY_GENERATION_TEMPLATE = TINY_TEMPLATE.replace("{{ m.content }}{{ eos_token }}",
                                                 "{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}")


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture
def tiny_tok(tiny_model) -> TextTokenizer:
    return TextTokenizer(tiny_model, 2, 0)


def tiny_chat_model(tmp_path: Path, tiny_model: Path, template: str) -> TextTokenizer:
    """The tiny model with a chat template, its bos/eos written as the tokenizer's added tokens."""
    from tokenizers import AddedToken, Tokenizer

    folder = tmp_path / "tiny-chat"
    shutil.copytree(tiny_model, folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    (folder / "chat_template.jinja").write_text(template)
    return TextTokenizer(folder, 2, 0)


def answer_tokens(sample) -> list[int]:
    return [t for t in sample.labels if t != IGNORE_INDEX]


def test_plain_rows_train_on_the_answer_and_eos(tiny_tok):
    """The tiny model's tokenizer adds no special tokens to a text: neither does plora."""
    [s], rep = tokenize_split([{"input": "abc>", "output": "cba"}], tiny_tok, 64, eval=True)
    assert s.tokens == tiny_tok.encode("abc>") + tiny_tok.encode("cba") + [2]
    assert answer_tokens(s) == tiny_tok.encode("cba") + [2]
    assert s.labels[:4] == [IGNORE_INDEX] * 4
    assert s.prompt == tiny_tok.encode("abc>") and s.reference == "cba"
    assert rep.rows == 1 and rep.truncated == 0 and not rep.dropped


SHIPPED = Path(__file__).resolve().parents[1] / "plora" / "assets" / "tiny-llama"


def _framed_model(tmp_path: Path, config: dict | None, template: str | None) -> Path:
    """The shipped tiny model with another tokenizer_config.json (None: none at all) and
    tokenizer.json post-processor (a TemplateProcessing ``single``, or None: none)."""
    from tokenizers import processors

    folder = tmp_path / "framed"
    shutil.copytree(SHIPPED, folder)
    (folder / "tokenizer_config.json").unlink()
    (folder / "special_tokens_map.json").unlink()
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
             "pad_token": "<pad>", "unk_token": "<unk>", **config}))
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["post_processor"] = None if template is None else json.loads(processors.TemplateProcessing(
        single=template, special_tokens=[("<bos>", 1), ("<eos>", 2)]).__getstate__())
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


@pytest.mark.parametrize("config, template", [
    ({"add_bos_token": True}, "<bos> $A"),  # the shipped demo model
    ({"add_bos_token": False, "add_eos_token": False}, None),
    ({"add_bos_token": True}, None),
    ({"add_bos_token": True, "add_eos_token": True}, None),
    ({}, "<bos> $A"),  # tokenizer.json's post-processor (Llama 3's way)
    ({}, "$A <eos>"),
    ({"add_bos_token": False}, "<bos> $A"),  # transformers 5 goes by tokenizer.json
    ({}, None),
    (None, None),  # no tokenizer_config.json at all
], ids=["shipped", "flags-off", "add-bos", "add-bos-and-eos", "post-processor-bos", "post-processor-eos", "flag-and-processor",
        "no-flags", "no-config"])
def test_plain_rows_are_framed_as_the_model_tokenizer_frames_a_text(tmp_path, config, template):
    """A prompt is what ``tokenizer(prompt)`` gives (less closing tokens, where the answer
    goes), a row what ``tokenizer(prompt + answer)`` gives, closed by eos: so transformers
    code prompts an adapter as plora trained and scored it (issue 46: plora put <bos> before
    every row where the demo model's tokenizer added none, and a 0.955 adapter scored 0 exact
    match in transformers)."""
    from transformers import AutoTokenizer

    folder = _framed_model(tmp_path, config, template)
    hf = AutoTokenizer.from_pretrained(str(folder))
    tok = TextTokenizer(folder, 2, 0)
    [s], _ = tokenize_split([{"input": "abc+", "output": "bca"}], tok, 64, eval=True)
    closing = list(tok.framing.suffix)
    assert s.prompt + closing == hf("abc+").input_ids
    full = hf("abc+bca").input_ids
    assert s.tokens == (full if closing else full + [2])
    assert answer_tokens(s) == tok.encode("bca") + (closing or [2])


def test_generation_stops_at_every_end_token_of_the_model(tmp_path):
    from plora.data.special_tokens import stop_ids

    folder = _framed_model(tmp_path, {}, None)
    assert stop_ids(folder, 2) == {2}  # generation_config.json: eos 2
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert stop_ids(folder, 2) == {2, 5}
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, 7]}))
    assert stop_ids(folder, 2) == {2, 7}


def test_prompt_template_for_plain_rows(tmp_path, tiny_tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "abc", "a": "cba"}])
    cfg = JobData(train=str(path), input_column="q", output_column="a", prompt_template="{input} > ")
    [ex] = load_split(cfg, "train")
    assert ex["input"] == "abc > " and ex["output"] == "cba" and ex["where"].endswith("d.jsonl line 1")
    [s] = tokenize_split([ex], tiny_tok, 64)[0]
    assert s.tokens[: len(s.tokens) - 4] == tiny_tok.encode("abc > ")


def test_prompt_template_names_other_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "x", "ctx": "abc", "output": "y"}])
    [ex] = load_split(JobData(train=str(path), prompt_template="{ctx} {input}="), "train")
    assert ex["input"] == "abc x="
    with pytest.raises(DataError, match=r"no column 'nope'"):
        load_split(JobData(train=str(path), prompt_template="{nope}"), "train")


def test_instruction_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"instruction": "reverse", "input": "abc", "output": "cba"},
        {"instruction": "say hi", "output": "hi"},
        {"instruction": "say hi", "input": None, "output": "hi"},
    ])
    a, b, c = load_split(JobData(train=str(path)), "train")  # format auto: the instruction column is there
    assert a["input"] == INSTRUCTION_TEMPLATE.format(instruction="reverse", input="abc") and a["output"] == "cba"
    assert b["input"] == c["input"] == INSTRUCTION_TEMPLATE_NO_INPUT.format(instruction="say hi")
    [d, *_] = load_split(JobData(train=str(path), format="instruction", prompt_template="{instruction}: {input}="),
                         "train")
    assert d["input"] == "reverse: abc="


def test_auto_format_from_the_columns(tmp_path):
    chat = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "a"},
                                                            {"role": "assistant", "content": "b"}]}])
    assert "messages" in load_split(JobData(train=str(chat)), "train")[0]
    plain = write_jsonl(tmp_path / "p.jsonl", [{"input": "a", "output": "b"}])
    assert load_split(JobData(train=str(plain)), "train")[0]["input"] == "a"
    with pytest.raises(DataError, match=r"no column 'messages' for the chat format"):
        load_split(JobData(train=str(plain), format="chat"), "train")


@pytest.mark.parametrize("template", [TINY_TEMPLATE, TINY_GENERATION_TEMPLATE], ids=["prefixes", "generation"])
def test_chat_rows_on_the_tiny_model(tmp_path, tiny_model, template):
    tok = tiny_chat_model(tmp_path, tiny_model, template)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc"},
                {"role": "assistant", "content": "cba"}, {"role": "user", "content": "xy"},
                {"role": "assistant", "content": "yx"}]
    [s], _ = tokenize_split([{"messages": messages}], tok, 64, eval=True)
    enc = tok.encode
    assert s.tokens == [1] + enc("be brief=abc=cba") + [2] + enc("xy=yx") + [2]
    # labels: exactly the assistant turns, each with its end-of-turn token
    assert answer_tokens(s) == enc("cba") + [2] + enc("yx") + [2]
    n_first = 1 + len(enc("be brief=abc="))
    assert all(t == IGNORE_INDEX for t in s.labels[:n_first]) and s.labels[n_first] != IGNORE_INDEX
    # eval: the prompt is everything before the last answer; the reference is that answer
    assert s.prompt == [1] + enc("be brief=abc=cba") + [2] + enc("xy=") and s.reference == "yx"


def test_chat_rows_need_a_chat_template(tmp_path, tiny_tok):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "a"},
                                                            {"role": "assistant", "content": "b"}]}])
    examples = load_split(JobData(train=str(path)), "train")
    with pytest.raises(DataError) as info:
        tokenize_split(examples, tiny_tok, 64)
    msg = str(info.value)
    assert "c.jsonl line 1" in msg and "has no" in msg and "chat template" in msg and "\n" not in msg


def test_chat_template_from_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "{{ bos_token }}ok"}]}))
    assert load_chat_template(tmp_path).render([]) == "<s>ok"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert load_chat_template(tmp_path) is None


def test_chat_template_raise_exception_is_one_line():
    t = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}")
    with pytest.raises(ValueError, match="first message must be user"):
        t.render([{"role": "assistant", "content": "x"}])


def test_long_rows_are_cut_and_counted(tiny_tok):
    rows = [{"input": "ab", "output": "cdefghij", "where": "f line 1"}, {"input": "ab", "output": "c"}]
    samples, rep = tokenize_split(rows, tiny_tok, 8)
    assert [len(s.tokens) for s in samples] == [8, 4] and rep.truncated == 1 and rep.rows == 2
    assert "1 of 2 rows are longer than model.max_seq_len 8" in rep.notes(8)[0]


def test_answer_cut_away_is_refused_with_its_line(tiny_tok):
    rows = [{"input": "ab", "output": "c", "where": "data.train: f.jsonl line 1"},
            {"input": "abcdefgh", "output": "c", "where": "data.train: f.jsonl line 2"}]
    with pytest.raises(DataError) as info:
        tokenize_split(rows, tiny_tok, 8)
    msg = str(info.value)
    assert msg.startswith("data.train: f.jsonl line 2: the answer is cut away entirely by model.max_seq_len 8")
    assert "1 of 2 rows" in msg and "on_bad_rows: drop" in msg
    samples, rep = tokenize_split(rows, tiny_tok, 8, on_bad_rows="drop")
    assert len(samples) == 1 and len(rep.dropped) == 1 and "1 rows dropped" in rep.notes(8)[-1]
    with pytest.raises(DataError, match="every row is"):
        tokenize_split(rows[1:], tiny_tok, 8, on_bad_rows="drop")


def test_rows_without_answer_are_dropped_and_counted_when_asked(tmp_path, tiny_tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "a", "output": "b"}, {"input": "a", "output": None},
                                              {"input": "a", "output": ""}, {"input": "a", "output": "c"}])
    data = prepare_data(JobData(train=str(path), on_bad_rows="drop"), JobEval(), tiny_tok, 64)
    assert len(data.train) == 2
    [note] = data.notes(64)
    assert "2 rows dropped" in note and "d.jsonl line 2, column 'output': is null" in note


def test_choices_from_a_column_and_from_the_spec(tmp_path, tiny_tok):
    train = write_jsonl(tmp_path / "t.jsonl", [{"input": "ab", "output": "x", "opts": ["x", "y"]}])
    ev = write_jsonl(tmp_path / "e.jsonl", [{"input": "ab", "output": "y", "opts": ["x", "y", "z"]}])
    data = prepare_data(JobData(train=str(train), eval=str(ev)), JobEval(choices_column="opts"), tiny_tok, 64)
    [s] = data.eval
    assert s.gold == 1 and len(s.choices) == 3
    assert answer_tokens(s.choices[2]) == tiny_tok.encode("z") + [2]
    assert s.choices[2].tokens[: len(s.prompt)] == s.prompt
    data = prepare_data(JobData(train=str(train), eval=str(ev)), JobEval(choices=["y", "x"]), tiny_tok, 64)
    assert data.eval[0].gold == 0
    with pytest.raises(DataError, match=r"e.jsonl line 1: the answer 'y' is not one of the choices \('a', 'b'\)"):
        prepare_data(JobData(train=str(train), eval=str(ev)), JobEval(choices=["a", "b"]), tiny_tok, 64)


# --------------------------------------------------------------------------- a real chat template


@pytest.fixture(scope="session")
def smollm2_tokenizer(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct's tokenizer and chat template, read from its GGUF (no weights)."""
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from plora.models.gguf import GGUFError, builtin_gguf_file

    try:  # the file only: the package's own imports (an llm plugin) are not needed
        gguf = builtin_gguf_file("smollm2-135m-instruct")
    except GGUFError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    return out


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Hello!"},
     {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "And goodbye?"},
     {"role": "assistant", "content": "Au revoir.\n\nÀ bientôt."}],
    [{"role": "user", "content": "  spaces  "}, {"role": "assistant", "content": " a leading space"}],
]


def _hf_ids(out) -> list[int]:
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "system-two-turns", "spaces"])
def test_smollm2_chat_matches_apply_chat_template(smollm2_tokenizer, messages):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_tokenizer))
    tok = TextTokenizer(smollm2_tokenizer, hf.eos_token_id, hf.pad_token_id)
    [s], _ = tokenize_split([{"messages": messages}], tok, 4096, eval=True)
    assert s.tokens == _hf_ids(hf.apply_chat_template(messages, tokenize=True))
    # the labels cover exactly the assistant turns: content, <|im_end|> and the newline after it
    labeled = hf.decode([t for t, l in zip(s.tokens, s.labels) if l != IGNORE_INDEX])
    assert labeled == "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")
    assert all(l in (IGNORE_INDEX, t) for t, l in zip(s.tokens, s.labels))
    head = messages[:-1]
    assert s.prompt == _hf_ids(hf.apply_chat_template(head, tokenize=True, add_generation_prompt=True))
    assert s.reference == messages[-1]["content"]


def test_smollm2_plain_rows_match_its_tokenizer(smollm2_tokenizer):
    """SmolLM2's tokenizer adds no bos to a text (its bos, <|im_start|>, opens chat turns)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_tokenizer))
    tok = TextTokenizer(smollm2_tokenizer, hf.eos_token_id, hf.pad_token_id)
    prompt, answer = "Tom has 12 apples, buys 7 more and then gives away 5. How many apples does he have?\n", "14"
    [s], _ = tokenize_split([{"input": prompt, "output": answer}], tok, 4096, eval=True)
    assert s.prompt == hf(prompt).input_ids
    assert s.tokens == hf(prompt).input_ids + hf(answer).input_ids + [hf.eos_token_id]
    assert tok.stop_ids == {hf.eos_token_id}


def test_smollm2_generation_blocks_match_the_assistant_mask(smollm2_tokenizer, tmp_path):
    """A template with {% generation %} blocks: the labels are transformers' assistant mask."""
    from transformers import AutoTokenizer

    source = (smollm2_tokenizer / "chat_template.jinja").read_text()
    marked = source.replace("{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}",
                            "{{'<|im_start|>' + message['role'] + '\n'}}{% if message['role'] == 'assistant' %}"
                            "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
                            "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}")
    assert marked != source
    folder = tmp_path / "tok"
    shutil.copytree(smollm2_tokenizer, folder)
    (folder / "chat_template.jinja").write_text(marked)
    hf = AutoTokenizer.from_pretrained(str(folder))
    tok = TextTokenizer(folder, hf.eos_token_id, hf.pad_token_id)
    messages = CONVERSATIONS[1]
    [s], _ = tokenize_split([{"messages": messages}], tok, 4096)
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert s.tokens == list(out["input_ids"])
    assert [int(l != IGNORE_INDEX) for l in s.labels] == list(out["assistant_masks"])


def test_jsonl_line_separators_inside_strings_and_crlf(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(('{"input": "a\u2028b", "output": "c"}\r\n\r\n{"input": "d", "output": "e"}\r\n').encode())
    a, b = load_split(JobData(train=str(path)), "train")
    assert a["input"] == "a\u2028b" and b["where"].endswith("line 3")


def test_csv_lines_are_counted_across_quoted_newlines(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('input,output\n"two\nlines",x\nb,\n')
    with pytest.raises(DataError, match=r"d.csv line 4, column 'output': is empty"):
        load_split(JobData(train=str(path)), "train")


def test_numbers_are_text(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": 3, "output": 42}, {"input": 0.5, "output": True}])
    a, b = load_split(JobData(train=str(path)), "train")
    assert (a["input"], a["output"], b["input"], b["output"]) == ("3", "42", "0.5", "true")
