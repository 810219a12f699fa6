"""Tool calls: each format reads back the calls its real template renders, whole and one character at a time, and
its grammar (over SmolLM2's tokenizer) accepts those calls and nothing else."""

import json

import llguidance
import mlx.core as mx
import pytest
from deltas import joined_reply
from llamacpp import llamacpp_template
from models import smollm2_path

from minimlx.errors import InvalidSettingError
from minimlx.text import Tokenizer
from minimlx.text.chat import chat_messages_for_template, render_chat
from minimlx.text.replies import ReplyParser
from minimlx.text.tool_formats import (
    DeepSeekFormat,
    GenericFormat,
    GlmFormat,
    HarmonyFormat,
    LlamaFormat,
    MistralFormat,
    ToolFormat,
    tool_format,
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time", "parameters": {"type": "object", "properties": {}}},
    },
]
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Köln"})]
QUESTION = [{"role": "user", "content": "Weather in Paris and Köln?"}]
# template -> (format, what the template writes after a reply: the end of the turn)
TEMPLATES = {
    "Qwen-Qwen3-0.6B": (ToolFormat, "<|im_end|>\n"),
    "Qwen-Qwen2.5-7B-Instruct": (ToolFormat, "<|im_end|>\n"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": (ToolFormat, "<|im_end|>\n"),
    "meta-llama-Llama-3.1-8B-Instruct": (LlamaFormat, "<|eot_id|>"),
    "meta-llama-Llama-3.3-70B-Instruct": (LlamaFormat, "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": (MistralFormat, "</s>"),
    "openai-gpt-oss-120b": (HarmonyFormat, ""),
    "deepseek-ai-DeepSeek-V3.1": (DeepSeekFormat, "<｜end▁of▁sentence｜>"),
    "GLM-4.6": (GlmFormat, ""),
    "HuggingFaceTB-SmolLM3-3B": (GenericFormat, "<|im_end|>\n"),
}


def openai_calls(calls):
    return [
        {"id": f"call{k:05d}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
        for k, (name, arguments) in enumerate(calls)
    ]


def render(source, messages, add_generation_prompt, tools=TOOLS):
    """As `Tokenizer.apply_chat_template` renders, thinking off (so the prompt holds any empty think block)."""
    messages, tools = tool_format(source).template_input(chat_messages_for_template(messages), tools)
    return render_chat(
        source, messages, add_generation_prompt, tools, bos_token="<s>", eos_token="</s>", enable_thinking=False
    )


def rendered_reply(name, calls):
    """The prompt, and the text the template writes for an assistant message making `calls` after it."""
    source = llamacpp_template(name)
    prompt = render(source, QUESTION, True)
    turn = render(source, [*QUESTION, {"role": "assistant", "content": None, "tool_calls": openai_calls(calls)}], False)
    end = TEMPLATES[name][1]
    assert turn.startswith(prompt) and turn.endswith(end)
    return source, prompt, turn[len(prompt) : len(turn) - len(end)]


def parsed(source, prompt, pieces, tools=True, reasoning=True):
    parser = ReplyParser(source, tools, reasoning, prompt)
    deltas = [delta for piece in pieces for delta in parser.feed(piece)] + parser.close()
    return deltas, joined_reply(deltas)


def calls_of(tool_calls):
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in tool_calls]


@pytest.mark.parametrize("name", [*TEMPLATES, "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"])
def test_format_is_read_from_the_template(name):
    expected = TEMPLATES.get(name, (GenericFormat,))[0]
    assert type(tool_format(llamacpp_template(name))) is expected


@pytest.mark.slow
def test_templates_without_tools_get_the_generic_format():
    metadata = mx.load(str(smollm2_path()), return_metadata=True)[1]
    assert type(tool_format(metadata["tokenizer.chat_template"])) is GenericFormat
    assert type(tool_format(None)) is GenericFormat


@pytest.mark.parametrize("name", TEMPLATES)
def test_rendered_calls_read_back(name):
    calls = CALLS if TEMPLATES[name][0].parallel else CALLS[:1]
    source, prompt, reply = rendered_reply(name, calls)
    for pieces in ([reply], list(reply)):
        deltas, (content, reasoning, tool_calls) = parsed(source, prompt, pieces)
        assert (content, reasoning) == (None, None), reply
        assert calls_of(tool_calls) == calls
        assert [c["function"]["arguments"] for c in tool_calls] == [
            json.dumps(a, ensure_ascii=False, separators=(",", ":")) for _, a in calls
        ]
        assert len({c["id"] for c in tool_calls}) == len(calls)
        assert [d.index for d in deltas if d.kind == "tool_call"] == list(range(len(calls)))


def test_a_call_is_announced_before_its_arguments_stream():
    source, prompt, reply = rendered_reply("Qwen-Qwen3-0.6B", CALLS[:1])
    deltas, _ = parsed(source, prompt, list(reply))
    assert deltas[0].kind == "tool_call" and deltas[0].name == "get_weather" and deltas[0].id.startswith("call_")
    assert [d.kind for d in deltas[1:]] == ["arguments"] * (len(deltas) - 1) and len(deltas) > 5


def test_content_around_calls_keeps_no_whitespace():
    source, prompt, reply = rendered_reply("Qwen-Qwen2.5-7B-Instruct", CALLS)
    text = f"Let me check.\n\n{reply}\n"
    for pieces in ([text], list(text)):
        _, (content, _, tool_calls) = parsed(source, prompt, pieces)
        assert content == "Let me check." and calls_of(tool_calls) == CALLS


def test_content_streams_as_soon_as_it_is_no_tag():
    parser = ReplyParser(llamacpp_template("Qwen-Qwen3-0.6B"), True, True, "")
    assert [(d.kind, d.text) for d in parser.feed("Hello <tool")] == [("content", "Hello")]
    assert [(d.kind, d.text) for d in parser.feed("box> x")] == [("content", " <toolbox> x")]


def test_harmony_calls_as_the_model_writes_them():
    """gpt-oss writes the recipient after the channel (the harmony spec), its template before it."""
    reply = (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>'
    )
    source = llamacpp_template("openai-gpt-oss-120b")
    for pieces in ([reply], list(reply)):
        _, (content, reasoning, tool_calls) = parsed(source, "<|start|>assistant", pieces)
        assert (content, reasoning, calls_of(tool_calls)) == (None, "Need the weather.", CALLS[:1])


def test_text_that_is_no_call_stays_content():
    source = llamacpp_template("Qwen-Qwen3-0.6B")
    for text in ["<tool_call>oops</tool_call>", '<tool_call>\n{"na']:
        _, (content, _, tool_calls) = parsed(source, "", list(text))
        assert (content, tool_calls) == (text, [])
    reply = rendered_reply("Qwen-Qwen3-0.6B", CALLS[:1])[2]
    _, (content, _, tool_calls) = parsed(source, "", [reply], tools=False)
    assert (content, tool_calls) == (reply, [])


def test_an_unterminated_call_keeps_what_was_written():
    source = llamacpp_template("Qwen-Qwen3-0.6B")
    _, (content, _, tool_calls) = parsed(source, "", ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'])
    assert content is None and tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city":"Pa'}


@pytest.mark.slow
def test_generic_format_describes_tools_and_writes_earlier_calls():
    metadata = mx.load(str(smollm2_path()), return_metadata=True)[1]
    tokenizer = Tokenizer.from_gguf(metadata)
    conversation = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": openai_calls(CALLS[:1])},
        {"role": "tool", "tool_call_id": "call00000", "content": "Sunny"},
    ]
    prompt = tokenizer.apply_chat_template(conversation, tools=TOOLS)
    assert prompt.startswith(
        "<|im_start|>system\nYou can call these tools:\n" + json.dumps(TOOLS[0], ensure_ascii=False)
    )
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>\n<|im_start|>user\n<tool_response>\nSunny\n" in prompt
    _, (_, _, tool_calls) = parsed(tokenizer.chat_template, prompt, list(call))
    assert calls_of(tool_calls) == CALLS[:1]


def test_templates_receive_tools_and_variables():
    source = llamacpp_template("Qwen-Qwen3-0.6B")
    prompt = render_chat(source, QUESTION, True, TOOLS)
    assert "<tools>\n" + "\n".join(json.dumps(tool, ensure_ascii=False) for tool in TOOLS) + "\n</tools>" in prompt
    assert render_chat(source, QUESTION, True, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    assert render_chat(source, QUESTION, True).endswith("<|im_start|>assistant\n")


def test_call_arguments_must_be_a_json_object():
    bad = [*QUESTION, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1"}}]}]
    with pytest.raises(InvalidSettingError, match="not a JSON object"):
        chat_messages_for_template(bad)


@pytest.fixture(scope="module")
def smollm2():
    metadata = mx.load(str(smollm2_path()), return_metadata=True)[1]
    tokenizer = Tokenizer.from_gguf(metadata)
    return tokenizer, llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=min(tokenizer.eos_token_ids))


def accepts(smollm2, grammar, text):
    tokenizer, lltokenizer = smollm2
    matcher = llguidance.LLMatcher(lltokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


@pytest.mark.slow
@pytest.mark.parametrize("name", TEMPLATES)
def test_grammars_force_valid_calls(name, smollm2):
    format = tool_format(llamacpp_template(name))
    one = format.grammar(TOOLS, "get_weather")
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(one)) == ""
    reply = rendered_reply(name, CALLS[:1])[2]
    assert accepts(smollm2, one, reply)
    assert not accepts(smollm2, one, reply.replace("get_weather", "get_time"))
    assert not accepts(smollm2, one, reply.replace('"Paris"', "3").replace(">Paris<", ">Paris<</arg_value>"))
    if format.parallel:
        assert accepts(smollm2, format.grammar(TOOLS, "required", parallel=True), rendered_reply(name, CALLS)[2])
        assert not accepts(smollm2, format.grammar(TOOLS, "required"), rendered_reply(name, CALLS)[2])


def test_grammar_for_an_unknown_tool_is_refused():
    with pytest.raises(InvalidSettingError, match="'get_news' names no tool"):
        ToolFormat().grammar(TOOLS, "get_news")


@pytest.mark.slow
def test_a_final_assistant_message_is_continued():
    tokenizer = Tokenizer.from_gguf(mx.load(str(smollm2_path()), return_metadata=True)[1])
    messages = [*QUESTION, {"role": "assistant", "content": "It will be"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\nIt will be"
    )
