"""Reasoning split from content: `<think>` blocks (Qwen3, DeepSeek-R1 distills) and harmony's analysis channel
(gpt-oss), in replies rendered by the real templates, whole, per character and with tags split across pieces."""

import pytest
from deltas import joined_reply
from llamacpp import llamacpp_template

from minimlx.text.chat import chat_messages_for_template, render_chat
from minimlx.text.replies import ReplyParser

QUESTION = [{"role": "user", "content": "Capital of France?"}]
ANSWER = {"role": "assistant", "content": "Paris.", "reasoning_content": "France's capital is Paris."}


def source_and_prompt(name, **variables):
    source = llamacpp_template(name)
    return source, render_chat(source, QUESTION, True, bos_token="<s>", **variables)


def prompt_and_reply(name, **variables):
    """The prompt and the reply the template writes for ANSWER after it."""
    source, prompt = source_and_prompt(name, **variables)
    turn = render_chat(source, chat_messages_for_template([*QUESTION, ANSWER]), False, bos_token="<s>", **variables)
    assert turn.startswith(prompt)
    return source, prompt, turn[len(prompt) :]


def split(source, prompt, pieces, reasoning=True):
    parser = ReplyParser(source, False, reasoning, prompt)
    return joined_reply([d for piece in pieces for d in parser.feed(piece)] + parser.close())[:2]


def every_split(text):
    """The text whole, per character, and cut in two at every place (so each tag is split once)."""
    yield [text]
    yield list(text)
    for k in range(1, len(text)):
        yield [text[:k], text[k:]]


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B", "openai-gpt-oss-120b"])
def test_reasoning_is_split_from_content(name):
    source, prompt, reply = prompt_and_reply(name)
    assert ANSWER["reasoning_content"] in reply
    for pieces in every_split(reply.removesuffix("<|im_end|>\n")):
        assert split(source, prompt, pieces) == ("Paris.", "France's capital is Paris.")


def test_a_prompt_that_opens_think_starts_the_reply_in_reasoning():
    source, prompt = source_and_prompt("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", enable_thinking=True)
    assert prompt.endswith("<｜Assistant｜><think>\n")
    for pieces in every_split("France's capital is Paris.\n</think>\n\nParis."):
        assert split(source, prompt, pieces) == ("Paris.", "France's capital is Paris.")


def test_a_prompt_that_closed_think_starts_the_reply_in_content():
    for name in ["deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "Qwen-Qwen3-0.6B"]:
        source, prompt = source_and_prompt(name, enable_thinking=False)
        assert prompt.rstrip().endswith("</think>")
        assert split(source, prompt, list("Paris.")) == ("Paris.", None)


def test_reasoning_off_keeps_think_text_in_content():
    source, prompt, reply = prompt_and_reply("Qwen-Qwen3-0.6B")
    reply = reply.removesuffix("<|im_end|>\n")
    assert split(source, prompt, list(reply), reasoning=False) == (reply, None)
