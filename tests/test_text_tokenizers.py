"""Tokenizers, chat templates and streaming detokenization against transformers' own (issue 4, acceptance 2 and 4)."""

import json

import mlx.core as mx
import pytest
from corpus import CORPUS
from models import smollm2_gguf
from reference import require
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models

from minimlx.errors import CheckpointError, InvalidSettingError, UnsupportedArchitectureError
from minimlx.text import Tokenizer
from minimlx.text.detokenizer import ByteDetokenizer, RedecodingDetokenizer

STREAMED = ["机器学习是人工智能的一个分支。你好，世界！", "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷 漢字😀😀"]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
WITH_SYSTEM = [
    {"role": "system", "content": "Answer in one word."},
    *MESSAGES,
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan? 日本"},
]


@pytest.fixture(scope="module")
def metadata():
    return mx.load(str(smollm2_gguf()), return_metadata=True)[1]


@pytest.fixture(scope="module")
def ours(metadata):
    return Tokenizer.from_gguf(metadata)


@pytest.fixture(scope="module")
def reference():
    require("gguf")
    transformers = require("transformers")
    path = smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def stream(tokenizer, ids, **options) -> list[str]:
    detokenizer = tokenizer.detokenizer(**options)
    return [detokenizer.add(token_id) for token_id in ids] + [detokenizer.finalize()]


@pytest.mark.slow
@pytest.mark.parametrize("text", CORPUS)
def test_gguf_ids_match_transformers(ours, reference, text):
    ids = ours.encode(text)
    assert ids == reference(text)["input_ids"]
    assert ours.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_gguf_special_tokens_match_transformers(metadata, ours, reference):
    assert ours.bos_token_id == reference.bos_token_id == 1
    assert ours.eos_token_ids == {reference.eos_token_id} == {2}
    assert ours.vocab_size == len(reference) == 49152
    assert ours.encode("<|im_end|>") == [2]
    with_end_of_turn = Tokenizer.from_gguf({**metadata, "tokenizer.ggml.eot_token_id": mx.array(0, dtype=mx.uint32)})
    assert with_end_of_turn.eos_token_ids == {0, 2}  # generation stops on any end token llama.cpp would stop on


@pytest.mark.slow
@pytest.mark.parametrize("messages", [MESSAGES, WITH_SYSTEM])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers(ours, reference, messages, add_generation_prompt):
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.slow
@pytest.mark.parametrize("text", STREAMED)
def test_streaming_detokenizer_equals_decode_token_by_token(ours, text):
    ids = ours.encode(text)
    pieces = stream(ours, ids)
    assert "".join(pieces) == ours.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)  # never half a character
    assert sum(piece == "" for piece in pieces) > 5  # bytes of split characters were held back
    assert isinstance(ours.detokenizer(), ByteDetokenizer)


@pytest.mark.slow
def test_streaming_detokenizer_skips_special_tokens(ours):
    ids = ours.encode(ours.apply_chat_template(MESSAGES) + "Paris 🇫🇷<|im_end|>")
    assert "".join(stream(ours, ids, skip_special_tokens=True)) == ours.decode(ids, skip_special_tokens=True)
    assert "".join(stream(ours, ids)) == ours.decode(ids)


@pytest.mark.slow
def test_invalid_utf8_streams_as_decode(ours):
    ids = ours.encode("😀")[:1] + ours.encode(" ok")  # a lone leading byte of a four-byte character
    assert "".join(stream(ours, ids)) == ours.decode(ids) == "\ufffd ok"


def with_pre(metadata: dict, pre: str) -> dict:
    """SmolLM2's vocabulary plus multi-digit tokens "12", "123", split by another pre-tokenizer."""
    return {
        **metadata,
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": metadata["tokenizer.ggml.tokens"] + ["12", "123"],
        "tokenizer.ggml.merges": metadata["tokenizer.ggml.merges"] + ["1 2", "12 3"],
        "tokenizer.ggml.token_type": metadata["tokenizer.ggml.token_type"].tolist() + [1, 1],
    }


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["gpt-2", "default", "llama-bpe", "qwen2"])
def test_pre_tokenizers_match_transformers(metadata, pre):
    require("transformers")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    changed = with_pre(metadata, pre)
    vocab = {name: changed[f"tokenizer.ggml.{name}"] for name in ("tokens", "merges", "token_type")}
    described = {"tokenizer_type": "gpt2", "pre_tokenizer_type": pre, **vocab}
    reference, _ = convert_gguf_tokenizer("llama", described)
    ours = Tokenizer.from_gguf(changed)
    for text in CORPUS:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ours.encode(text)) == text


@pytest.mark.slow
def test_pre_tokenizers_split_digits_their_own_way(metadata):
    digits = {
        pre: Tokenizer.from_gguf(with_pre(metadata, pre)).encode("4123") for pre in ("smollm", "gpt-2", "llama-bpe")
    }
    four, one, two, three, twelve, one_two_three = 36, 33, 34, 35, 49152, 49153
    assert digits == {
        "smollm": [four, one, two, three],  # each digit alone
        "gpt-2": [four, one_two_three],  # digits together
        "llama-bpe": [four, twelve, three],
    }  # digits in threes: "412", "3"


def sentencepiece_metadata() -> dict:
    """A tiny SentencePiece GGUF vocabulary: specials, 256 byte tokens, pieces with scores (higher merges first)."""
    pieces = ["▁", "t", "h", "e", "a", "n", "d", "o", "▁t", "he", "▁the", "an", "▁an", "nd", "▁and", "▁a", "▁▁", "▁to"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256)), *pieces]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": mx.array([0.0] * 259 + [-float(i) for i in range(len(pieces))]),
        "tokenizer.ggml.token_type": mx.array([2, 3, 3] + [6] * 256 + [1] * len(pieces)),
        "tokenizer.ggml.bos_token_id": mx.array(1),
        "tokenizer.ggml.eos_token_id": mx.array(2),
        "tokenizer.ggml.unknown_token_id": mx.array(0),
    }


SPM_TEXTS = ["the and an to", "the  and\n 你好 😀", "hat hand 🇫🇷 ", "a"]


def test_sentencepiece_gguf_matches_transformers():
    require("transformers")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    metadata = sentencepiece_metadata()
    vocab = {key: metadata[f"tokenizer.ggml.{key}"] for key in ("tokens", "scores", "token_type")}
    reference, _ = convert_gguf_tokenizer(
        "llama",
        {
            "tokenizer_type": "llama",
            "tokens": vocab["tokens"],
            "scores": vocab["scores"].tolist(),
            "token_type": vocab["token_type"].tolist(),
        },
    )
    ours = Tokenizer.from_gguf(metadata)
    assert ours.bos_token_id == 1 and ours.eos_token_ids == {2}
    for text in SPM_TEXTS:
        ids = ours.encode(text)
        assert ids == [1] + reference.encode(text, add_special_tokens=False).ids  # llama.cpp adds BOS by default
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids) == text
        assert "".join(stream(ours, ids, skip_special_tokens=True)) == text
        assert "".join(stream(ours, ids)) == ours.decode(ids) == "<s> " + text  # the space stays after a token
    assert isinstance(ours.detokenizer(), ByteDetokenizer)


@pytest.fixture(scope="module")
def smollm2_folder(reference, tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2")
    reference.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_folder_tokenizer_matches_transformers(smollm2_folder, reference):
    (smollm2_folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ours = Tokenizer.from_folder(smollm2_folder)
    assert ours.eos_token_ids == {2, 0} and ours.bos_token_id == 1
    for text in CORPUS:
        assert ours.encode(text) == reference(text)["input_ids"]
    expected = reference.apply_chat_template(WITH_SYSTEM, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(WITH_SYSTEM) == expected


@pytest.mark.slow
def test_folder_add_bos_token_and_config_template(smollm2_folder, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((smollm2_folder / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    template = "{{ bos_token }}{{ messages[0]['content'] }}"
    config.update(
        add_bos_token=True,
        chat_template=[{"name": "tool_use", "template": ""}, {"name": "default", "template": template}],
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_folder(tmp_path)
    assert ours.encode("hi") == [1, 6004] and ours.encode("hi", add_special_tokens=False) == [6004]
    assert ours.apply_chat_template(MESSAGES) == "<|im_start|>What is the capital of France?"


def test_sentencepiece_folder_streams_with_byte_fallback(tmp_path):
    transformers = require("transformers")
    metadata = sentencepiece_metadata()
    vocab = {token: i for i, token in enumerate(metadata["tokenizer.ggml.tokens"])}
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("a", "n"), ("▁", "a")]
    transformers.LlamaTokenizer(vocab=vocab, merges=merges).save_pretrained(tmp_path)
    ours, reference = Tokenizer.from_folder(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(ours.detokenizer(), ByteDetokenizer)
    for text in SPM_TEXTS + STREAMED:
        ids = [1] + ours.encode(text)
        assert ids[1:] == reference(text)["input_ids"] and ours.decode(ids, skip_special_tokens=True) == text
        for skip in (False, True):
            pieces = stream(ours, ids, skip_special_tokens=skip)
            assert "".join(pieces) == ours.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in piece for piece in pieces)


def test_other_decoders_stream_by_redecoding():
    backend = Backend(models.WordPiece({"[UNK]": 0, "play": 1, "##ing": 2, "你": 3}, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    tokenizer = Tokenizer(backend, None, None, set(), None)
    assert isinstance(tokenizer.detokenizer(), RedecodingDetokenizer)
    ids = [1, 2, 3, 1]
    assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids) == "playing 你 play"


def test_chat_template_helpers_render_as_transformers():
    require("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}\n"
        "  {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "{% endfor %}{{ strftime_now('%Y') }}{{ eos_token }}{% if add_generation_prompt %}>{% endif %}"
    )
    expected = render_jinja_template(
        [WITH_SYSTEM], chat_template=template, add_generation_prompt=True, eos_token="</s>"
    )[0][0]
    ours = Tokenizer(Backend(models.BPE()), None, "</s>", set(), template)
    assert ours.apply_chat_template(WITH_SYSTEM) == expected
    assert "日本" not in expected and '"Paris."' in expected  # the loop broke after the third message


def test_errors_name_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="tokenizer model 'bert'.*tokenizer.json"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "bert"})
    with pytest.raises(UnsupportedArchitectureError, match="pre-tokenizer 'made-up'"):
        vocab = {"tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": []}
        Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "made-up", **vocab})
    refusing = Tokenizer(Backend(models.BPE()), None, None, set(), "{{ raise_exception('Roles must alternate') }}")
    with pytest.raises(InvalidSettingError, match="Roles must alternate.*--no-chat-template"):
        refusing.apply_chat_template(MESSAGES)
    with pytest.raises(InvalidSettingError, match="no chat template.*--no-chat-template"):
        Tokenizer(Backend(models.BPE()), None, None, set(), None).apply_chat_template(MESSAGES)
