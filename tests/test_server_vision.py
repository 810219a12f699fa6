"""`minimlx serve` with images, through the official `openai` (chat completions, Responses) and `anthropic` clients and
Ollama's API: the greedy answers equal transformers' on the same picture, a forced tool call with an image, a
conversation about one image that prefills only its new tokens (and never reuses another image's cache), four image
requests decoding in one batch, image URLs fetched under `--allow-image-urls` (from a local HTTP server), and bad
images refused in each API's own error shape while the server goes on.

One server per module, in-process (Starlette's TestClient, which the clients take as their HTTP client), on the tiny
random Gemma 3 of vision_models.py over its character tokenizer."""

import base64
import http.server
import io
import json
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from models import TINY_LLAMA, write_model
from PIL import Image
from reference import require
from vision_models import (
    CHAT_IMAGE_TOKEN,
    EOS,
    IDEFICS3_SHAPES,
    MISTRAL3_CHAT_TOKENS,
    PARTS_TEMPLATE,
    QWEN_SHAPES,
    gemma3_processor,
    gemma4_inputs,
    pictures,
    pixtral_inputs,
    pixtral_layout,
    qwen_inputs,
    save_gemma3_chat,
    save_gemma4_chat,
    save_mistral3_chat,
    save_qwen3_image_text,
)

import minimlx
from minimlx.decode import Engine
from minimlx.vision import ImageLimits, open_image

pytestmark = pytest.mark.slow  # servers
MAX_TOKENS = 8
ASK = ("Describe ", " briefly.")  # the text around the picture in every request's user message


def data(picture, kind: str = "PNG") -> str:
    """A picture's bytes in base64."""
    out = io.BytesIO()
    picture.save(out, kind)
    return base64.b64encode(out.getvalue()).decode()


def data_url(picture) -> str:
    return f"data:image/png;base64,{data(picture)}"


def chat_content(picture) -> list[dict]:
    image = {"type": "image_url", "image_url": {"url": data_url(picture)}}
    return [{"type": "text", "text": ASK[0]}, image, {"type": "text", "text": ASK[1]}]


class InProcessServer:
    """The in-process server of one model: its TestClient, engine, the model and tokenizer it serves."""

    def __init__(self, folder, name: str, serving=None):
        from starlette.testclient import TestClient

        from minimlx.server.app import Server
        from minimlx.server.models import Models, Serving

        self.folder = folder
        self.model, self.tokenizer = minimlx.load(folder, dtype="float32")
        self.engine = Engine(self.model, self.tokenizer, max_batch=8, prompt_cache_size=8)
        self.client = TestClient(Server(Models.one(self.engine, name, serving or Serving())).app)

    def openai(self):
        return require("openai").OpenAI(base_url="http://testserver/v1", api_key="-", http_client=self.client)

    def anthropic(self):
        return require("anthropic").Anthropic(base_url="http://testserver", api_key="-", http_client=self.client)

    def prompt(self, messages: list[dict]) -> list[int]:
        """The ids of `messages` templated, each image's place the model's image start token, written in the text as
        the family's processor writes it (its places in the ids not yet written out)."""
        marker = self.tokenizer.decode([self.model.config.image_start_token])
        text = self.tokenizer.apply_chat_template(messages).replace("\ue000", marker)
        return self.tokenizer.encode(self.model.config.write_images_text(text), add_special_tokens=False)

    def cold(self, messages: list[dict], images: list, logit_bias: dict | None = None) -> str:
        """The greedy answer to `messages` (their image places as the model's image start token) read from an empty
        cache, outside the server: what every answer of the server must equal."""
        ids = self.prompt(messages)
        steps = minimlx.stream_generate(
            self.model, self.tokenizer, ids, images=images, max_tokens=MAX_TOKENS, logit_bias=logit_bias
        )
        return self.tokenizer.decode([r.token for r in steps if r.token != EOS])


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(the server, the transformers model, its Gemma3Processor)."""
    folder = tmp_path_factory.mktemp("gemma3-chat")
    torch_model, image_processor = save_gemma3_chat(folder)
    served = InProcessServer(folder, "tiny")
    with served.client:
        yield served, torch_model, gemma3_processor(folder, image_processor)


def processor_inputs(processor, messages: list[dict], images: list) -> dict:
    """Gemma3Processor's inputs (ids, pixels, token types as torch tensors) of `messages` (with image parts) and
    `images`: the text its chat template writes, each image written out as the processor writes it."""
    text = processor.tokenizer.apply_chat_template(messages, chat_template=PARTS_TEMPLATE, tokenize=False)
    return processor(text=text, images=images, add_special_tokens=False, return_tensors="pt")


def transformers_answer(served: InProcessServer, torch_model, processor, picture) -> str:
    """transformers' greedy answer to the user message ASK around `picture`, its processor's inputs: each token the
    argmax of its forward pass over the whole text so far (the image's tokens marked, so that they see each other
    both ways)."""
    torch = require("torch")
    parts = [{"type": "text", "text": ASK[0]}, {"type": "image"}, {"type": "text", "text": ASK[1]}]
    inputs = processor_inputs(processor, [{"role": "user", "content": parts}], [picture])
    ids, pixels = inputs["input_ids"], inputs["pixel_values"]
    answer = []
    with torch.no_grad():
        while len(answer) < MAX_TOKENS and EOS not in answer:
            logits = torch_model(
                input_ids=ids, pixel_values=pixels, token_type_ids=(ids == CHAT_IMAGE_TOKEN).long()
            ).logits
            answer.append(int(logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([answer[-1:]])], dim=1)
    return served.tokenizer.decode([t for t in answer if t != EOS])


def test_each_api_answers_an_image_as_transformers_does_streamed_and_not(gemma3):
    served, torch_model, processor = gemma3
    picture = pictures()[0]
    expected = transformers_answer(served, torch_model, processor, picture)
    plain = [{"role": "user", "content": "\ue000".join(ASK)}]
    assert expected and expected == served.cold(plain, [picture]) != served.cold(plain, [pictures()[2]])
    openai, anthropic = served.openai(), served.anthropic()
    settings = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0)
    messages = [{"role": "user", "content": chat_content(picture)}]
    answers = {"chat": openai.chat.completions.create(messages=messages, **settings).choices[0].message.content}
    stream = openai.chat.completions.create(messages=messages, stream=True, **settings)
    answers["chat, streamed"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    image = {"type": "input_image", "image_url": data_url(picture)}
    content = [{"type": "input_text", "text": ASK[0]}, image, {"type": "input_text", "text": ASK[1]}]
    responses = dict(model="tiny", input=[{"role": "user", "content": content}], max_output_tokens=MAX_TOKENS)
    answers["responses"] = openai.responses.create(**responses, temperature=0).output_text
    events = openai.responses.create(**responses, temperature=0, stream=True)
    answers["responses, streamed"] = "".join(e.delta for e in events if e.type == "response.output_text.delta")

    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data(picture)}}
    content = [{"type": "text", "text": ASK[0]}, block, {"type": "text", "text": ASK[1]}]
    settings = dict(model="tiny", max_tokens=MAX_TOKENS, extra_body={"temperature": 0})  # (this client's own: none)
    message = anthropic.messages.create(messages=[{"role": "user", "content": content}], **settings)
    answers["messages"] = "".join(b.text for b in message.content)
    with anthropic.messages.stream(messages=[{"role": "user", "content": content}], **settings) as stream:
        answers["messages, streamed"] = "".join(stream.text_stream)
    assert answers == dict.fromkeys(answers, expected)

    # Ollama's images go before the message's text
    body = {"model": "tiny", "stream": False, "options": {"temperature": 0, "num_predict": MAX_TOKENS}}
    ollama = {"role": "user", "content": "What is this?", "images": [data(picture, "JPEG")]}
    reply = served.client.post("/api/chat", json=body | {"messages": [ollama]}).json()["message"]["content"]
    jpeg = open_image(base64.b64decode(ollama["images"][0]))
    assert reply == served.cold([{"role": "user", "content": "\ue000What is this?"}], [jpeg])
    generate = body | {"prompt": ollama["content"], "images": ollama["images"]}
    assert served.client.post("/api/generate", json=generate).json()["response"] == reply

    count = {"model": "tiny", "messages": [{"role": "user", "content": content}]}  # the image's places counted too
    counted = served.client.post("/v1/messages/count_tokens", json=count).json()["input_tokens"]
    assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_gemma3_prompts_hold_their_images_as_its_processor_writes_them(gemma3):
    """One or two images in raw text and in a chat message's parts, through generate's prompt, a chat, the server's
    count and the explainer: Gemma3Processor's ids (blank lines around each image's tokens, which a tokenizer merges
    with the text beside them); a prompt written out already is kept as it is."""
    from minimlx.decode.conversation import Conversation
    from minimlx.decode.images import PromptImages
    from minimlx.decode.prompt import prompt_ids
    from minimlx.explainer.images import ExplainedImage
    from minimlx.explainer.walk import prompt_ids as explainer_ids

    served, _, processor = gemma3
    model, tokenizer, start = served.model, served.tokenizer, "<start_of_image>"

    def ours(text: str, images: list, chat_template: bool) -> list[int]:
        return PromptImages.read(model, prompt_ids(model, tokenizer, text, chat_template, images=True), images)[0]

    for images in (pictures()[:1], pictures()[1:]):
        raw = "Compare " + " with ".join([start] * len(images)) + " please."
        expected = processor(text=raw, images=images)["input_ids"][0]
        assert expected.count(CHAT_IMAGE_TOKEN) == 16 * len(images) and ours(raw, images, False) == expected
        assert ours(model.config.write_images_text(raw), images, False) == expected

        parts = [{"type": "text", "text": "Compare "}, {"type": "image"}, {"type": "text", "text": " with "}]
        parts = parts[: 2 * len(images)] + [{"type": "image"}] * (len(images) == 2) + [{"type": "text", "text": "!"}]
        expected = processor_inputs(processor, [{"role": "user", "content": parts}], images)["input_ids"][0].tolist()
        text = "".join(start if p["type"] == "image" else p["text"] for p in parts)
        assert ours(text, images, True) == expected
        blocks = [{"type": "image", "source": {"type": "base64", "data": data(i)}} for i in images]
        content = [{"type": "text", "text": "Compare "}, blocks[0]] + [{"type": "text", "text": " with "}] + blocks[1:]
        content = content[: 2 * len(images)] + [{"type": "text", "text": "!"}]
        count = {"model": "tiny", "messages": [{"role": "user", "content": content}]}
        assert served.client.post("/v1/messages/count_tokens", json=count).json()["input_tokens"] == len(expected)

        chat = Conversation(model, tokenizer)
        list(chat.say("What?", images=images, max_tokens=1))
        parts = [{"type": "image"}] * len(images) + [{"type": "text", "text": "What?"}]
        expected = processor_inputs(processor, [{"role": "user", "content": parts}], images)["input_ids"][0].tolist()
        assert chat.cached_ids[: len(expected)] == expected

    image = ExplainedImage.read(model, tokenizer, pictures()[0])
    parts = [{"type": "image"}, {"type": "text", "text": "What?"}]
    expected = processor_inputs(processor, [{"role": "user", "content": parts}], [pictures()[0]])["input_ids"][0]
    assert image.ids(explainer_ids(tokenizer, "What?", True, image), 256) == expected.tolist()


def test_a_forced_tool_call_with_an_image_is_a_valid_call(gemma3):
    served, *_ = gemma3
    assert_forced_tool_call(served.openai(), pictures()[1])


def assert_forced_tool_call(openai, picture) -> None:
    """A chat completion about `picture` with a forced function call returns a valid call of it."""
    city = {"type": "string", "enum": ["Paris", "Rome"]}
    parameters = {"type": "object", "properties": {"city": city}, "required": ["city"], "additionalProperties": False}
    tool = {"name": "get_weather", "parameters": parameters}
    answer = openai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": chat_content(picture)}],
        tools=[{"type": "function", "function": tool}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
        temperature=0,
        logit_bias={"0": -100, "1": -100},  # newline, space: where the call's grammar allows them, a random model
    )  # would write them on and on
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in city["enum"]
    assert answer.choices[0].finish_reason == "tool_calls"


def test_three_turns_about_one_image_prefill_only_their_new_tokens(gemma3):
    """Turns 2 and 3 reuse the cache of the turn before (the usage's cached tokens: all but the new turn's, and the
    last answer token, never fed, where the answer ran to its limit) and answer as a cold read does; the same text
    about another picture reuses nothing, its image's places keyed by its pixels."""
    served, *_ = gemma3
    openai, picture = served.openai(), pictures()[2]
    history = [{"role": "user", "content": chat_content(picture)}]
    plain = [{"role": "user", "content": "\ue000".join(ASK)}]  # the same, as `cold` reads it
    finish = None
    for turn in range(3):
        if turn:
            question = f"And the {'colours' if turn == 1 else 'shapes'}?"
            history.append({"role": "user", "content": question})
            plain.append({"role": "user", "content": question})
        answer = openai.chat.completions.create(model="tiny", messages=history, max_tokens=MAX_TOKENS, temperature=0)
        text, usage = answer.choices[0].message.content, answer.usage
        assert text == served.cold(plain, [picture])
        assert usage.prompt_tokens == prompt_tokens(served, plain)
        new = len(f"\nuser:{plain[-1]['content']}\nassistant:") + (finish == "length")  # a token per character
        assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - new if turn else 0)
        finish = answer.choices[0].finish_reason
        history.append({"role": "assistant", "content": text})
        plain.append({"role": "assistant", "content": text})
    other = pictures()[0]
    answer = openai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": chat_content(other)}], max_tokens=MAX_TOKENS, temperature=0
    )
    assert answer.usage.prompt_tokens_details.cached_tokens == 0
    assert answer.choices[0].message.content == served.cold(plain[:1], [other]) != plain[1]["content"]


def prompt_tokens(served: InProcessServer, messages: list[dict]) -> int:
    """The prompt tokens of `messages` (their image places as the model writes them out)."""
    return len(served.model.config.expand_images(served.prompt(messages)))


def test_four_image_requests_decode_in_one_batch(gemma3, monkeypatch):
    from minimlx.server import bridge

    served, *_ = gemma3
    monkeypatch.setattr(bridge, "GATHER_QUIET", 0.3)  # the four arrive while the idle server waits for more
    openai, four = served.openai(), pictures([(40, 40), (30, 80), (90, 20), (64, 64)], seed=7)
    no_end = {str(EOS): -100}  # every answer runs to its limit: the four decode together throughout

    def ask(picture):
        messages = [{"role": "user", "content": chat_content(picture)}]
        answer = openai.chat.completions.create(
            model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0, logit_bias=no_end
        )
        return answer.choices[0].message.content

    served.engine.runner.batch_sizes.clear()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, four))
    assert max(served.engine.runner.batch_sizes) == 4
    plain = [{"role": "user", "content": "\ue000".join(ASK)}]
    assert answers == [served.cold(plain, [picture], logit_bias={EOS: -100}) for picture in four]


@pytest.fixture(scope="module")
def qwen2_5_vl(qwen2_5_vl_chat):
    """(the server of the tiny Qwen2.5-VL, the transformers model, its image processor)."""
    folder, torch_model, processor = qwen2_5_vl_chat
    served = InProcessServer(folder, "tiny")
    with served.client:
        yield served, torch_model, processor


def test_qwen2_5_vl_answers_as_transformers_generate_and_its_next_turn_reuses_the_cache(qwen2_5_vl):
    """A picture resized to a 16 x 10 patch grid (8 x 5 soft tokens): the answer equals transformers' `generate`
    through chat completions (streamed and not); the next turn prefills only its new tokens (the positions after the
    image shifted as in the first turn) and answers as a cold read does; Responses and Messages (streamed and not)
    give the same answer and a forced tool call is valid."""
    served, torch_model, processor = qwen2_5_vl
    picture, openai = pictures(QWEN_SHAPES)[2], served.openai()
    expected, prompt_tokens = qwen_greedy_answer(served, torch_model, processor, picture)
    first = assert_chat_completions_answer(openai, [{"role": "user", "content": chat_content(picture)}], expected)
    check_next_turn(served, picture, first, prompt_tokens)
    assert_every_api_answers(served, picture, expected)


def check_next_turn(served: InProcessServer, picture, first, prompt_tokens: int) -> None:
    """The turn after `first` (the answer about `picture` to a prompt of `prompt_tokens`) prefills only its new
    tokens and answers as a cold read of the conversation does."""
    turns = [{"role": "assistant", "content": first.choices[0].message.content}]
    turns += [{"role": "user", "content": "And the colours?"}]
    history = [{"role": "user", "content": chat_content(picture)}, *turns]
    plain = [{"role": "user", "content": "\ue000".join(ASK)}, *turns]
    settings = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0)
    second = served.openai().chat.completions.create(messages=history, **settings)
    usage, new = second.usage, len("\nuser:And the colours?\nassistant:") + (first.choices[0].finish_reason == "length")
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - new > prompt_tokens - 2
    assert second.choices[0].message.content == served.cold(plain, [picture])


def qwen_greedy_answer(served, torch_model, processor, picture) -> tuple[str, int]:
    """(transformers' greedy answer to `ASK` about `picture` under the served model's chat template, as text; the
    prompt's tokens)."""
    torch = require("torch")
    plain = [{"role": "user", "content": "\ue000".join(ASK)}]
    ids = served.model.config.expand_images(served.prompt(plain), served.model.image_processor([picture]))
    ids = torch.tensor([ids])
    with torch.no_grad():
        out = torch_model.generate(
            input_ids=ids,
            mm_token_type_ids=(ids == CHAT_IMAGE_TOKEN).int(),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            **qwen_inputs(processor, [picture]),
        )
    return served.tokenizer.decode([t for t in out[0, ids.shape[1] :].tolist() if t != EOS]), ids.shape[1]


def assert_every_api_answers(served: InProcessServer, picture, expected: str) -> None:
    """Responses (`input_image`) and Messages (a base64 `image` block), streamed and not, answer `ASK` about `picture`
    with `expected` (what chat completions gave), and a forced tool call with the picture is a valid call."""
    openai = served.openai()
    image = {"type": "input_image", "image_url": data_url(picture)}
    content = [{"type": "input_text", "text": ASK[0]}, image, {"type": "input_text", "text": ASK[1]}]
    responses = dict(model="tiny", input=[{"role": "user", "content": content}], max_output_tokens=MAX_TOKENS)
    answers = {"responses": openai.responses.create(**responses, temperature=0).output_text}
    events = openai.responses.create(**responses, temperature=0, stream=True)
    answers["responses, streamed"] = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data(picture)}}
    text = [{"type": "text", "text": ASK[0]}, block, {"type": "text", "text": ASK[1]}]
    messages = [{"role": "user", "content": text}]
    settings = dict(model="tiny", max_tokens=MAX_TOKENS, extra_body={"temperature": 0})
    anthropic = served.anthropic()
    answers["messages"] = "".join(b.text for b in anthropic.messages.create(messages=messages, **settings).content)
    with anthropic.messages.stream(messages=messages, **settings) as stream:
        answers["messages, streamed"] = "".join(stream.text_stream)
    assert answers == dict.fromkeys(answers, expected)
    assert_forced_tool_call(openai, picture)


def assert_chat_completions_answer(openai, history: list[dict], expected: str):
    """Chat completions answers `history` with `expected`, streamed and not; returns the unstreamed completion."""
    settings = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0)
    first = openai.chat.completions.create(messages=history, **settings)
    stream = openai.chat.completions.create(messages=history, stream=True, **settings)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert expected and first.choices[0].message.content == streamed == expected
    return first


@pytest.mark.parametrize("family", ["Qwen3VL", "Qwen3_5"])
def test_qwen3_vl_and_qwen3_5_answer_as_transformers_generate(family, qwen3_vl_chat, tmp_path):
    """Qwen3-VL (DeepStack levels, an interleaved multimodal RoPE) and Qwen3.5 (its hybrid text model) through chat
    completions, streamed and not, with the picture of 16 x 10 patches: the answer equals transformers' `generate`;
    so do Responses' and Messages', and a forced tool call is a valid call."""
    if family == "Qwen3VL":
        folder, torch_model, processor = qwen3_vl_chat
    else:
        folder, (torch_model, processor) = tmp_path, save_qwen3_image_text(tmp_path, family, chat=True)
    served = InProcessServer(folder, "tiny")
    with served.client:
        picture = pictures(QWEN_SHAPES)[2]
        expected, _ = qwen_greedy_answer(served, torch_model, processor, picture)
        assert_chat_completions_answer(served.openai(), [{"role": "user", "content": chat_content(picture)}], expected)
        assert_every_api_answers(served, picture, expected)


def test_idefics3_answers_as_transformers_generate(idefics3_chat):
    """Idefics3 (pictures cut into tiles): a chat completion whose user message holds three pictures between its words
    (the chat template's image places become `<image>`s, written out as the processor writes them) answers as
    transformers' greedy `generate` on that text, and its usage counts the written-out prompt; one picture of 2 x 2
    tiles answers as `generate` does through chat completions (streamed and not), Responses and Messages, and a
    forced tool call with it is a valid call."""
    folder, torch_model, processor = idefics3_chat
    served = InProcessServer(folder, "tiny")
    with served.client:
        three = pictures(IDEFICS3_SHAPES)
        content = [{"type": "text", "text": "What is"}]
        content += [{"type": "image_url", "image_url": {"url": data_url(picture)}} for picture in three]
        content += [{"type": "text", "text": " this?"}]
        answer = served.openai().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0
        )
        expected, prompt_tokens = idefics3_answer(processor, torch_model, "What is<image><image><image> this?", three)
        assert answer.usage.prompt_tokens == prompt_tokens
        assert answer.choices[0].message.content == expected

        picture = three[1]
        expected, _ = idefics3_answer(processor, torch_model, "<image>".join(ASK), [picture])
        assert_chat_completions_answer(served.openai(), [{"role": "user", "content": chat_content(picture)}], expected)
        assert_every_api_answers(served, picture, expected)


def idefics3_answer(processor, torch_model, question: str, images) -> tuple[str, int]:
    """(transformers' greedy answer to the user message `question` about `images` under the character tokenizer's
    chat template, as text; the prompt's tokens as the processor writes them out)."""
    torch = require("torch")
    inputs = processor(text=f"user:{question}\nassistant:", images=[images], return_tensors="pt")
    with torch.no_grad():
        out = torch_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    prompt_tokens, end = inputs["input_ids"].shape[1], processor.tokenizer.eos_token_id
    return processor.tokenizer.decode([t for t in out[0, prompt_tokens:].tolist() if t != end]), prompt_tokens


def test_mistral3_answers_as_transformers_generate(tmp_path):
    """Mistral 3 (the Pixtral encoder; its [IMG_BREAK] and [IMG_END] the tokenizer's, not at tekken's ids): three
    pictures side by side in a message answer as transformers' `generate` on the layout Pixtral's processor writes;
    a wide picture scaled down to 3 x 6 soft tokens does so through chat completions (streamed and not), Responses
    and Messages, and a forced tool call with it is a valid call."""
    torch_model, processor = save_mistral3_chat(tmp_path, seed=2)  # a seed whose answers follow the picture
    served = InProcessServer(tmp_path, "tiny")
    with served.client:
        three = pictures()
        content = [{"type": "text", "text": "What is"}]
        content += [{"type": "image_url", "image_url": {"url": data_url(picture)}} for picture in three]
        content += [{"type": "text", "text": " this?"}]
        answer = served.openai().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0
        )
        expected, prompt_tokens = mistral3_answer(
            served, torch_model, processor, "What is\ue000\ue000\ue000 this?", three
        )
        assert answer.usage.prompt_tokens == prompt_tokens
        assert answer.choices[0].message.content == expected

        picture = pictures()[0]
        expected, _ = mistral3_answer(served, torch_model, processor, "\ue000".join(ASK), [picture])
        plain = [{"role": "user", "content": "\ue000".join(ASK)}]
        assert served.cold(plain, [picture]) == expected != served.cold(plain, [pictures()[2]])
        assert_chat_completions_answer(served.openai(), [{"role": "user", "content": chat_content(picture)}], expected)
        assert_every_api_answers(served, picture, expected)


def mistral3_answer(served: InProcessServer, torch_model, processor, question: str, images) -> tuple[str, int]:
    """(transformers' greedy answer to the user message `question` (its image places "\ue000") about `images`, each
    place written out as Pixtral's processor writes it, as text; the prompt's tokens)."""
    torch = require("torch")
    reference = pixtral_inputs(processor, images)
    sizes, ids = iter(reference["image_sizes"]), []
    for token in served.prompt([{"role": "user", "content": question}]):
        ids += pixtral_layout(*next(sizes), MISTRAL3_CHAT_TOKENS) if token == MISTRAL3_CHAT_TOKENS[0] else [token]
    with torch.no_grad():
        out = torch_model.generate(
            input_ids=torch.tensor([ids]),
            pixel_values=torch.tensor(reference["pixel_values"]),
            image_sizes=torch.tensor(reference["image_sizes"]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    return served.tokenizer.decode([t for t in out[0, len(ids) :].tolist() if t != EOS]), len(ids)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """(the server of the tiny Gemma 4, the transformers model, its image processor)."""
    folder = tmp_path_factory.mktemp("gemma4-chat")
    torch_model, processor = save_gemma4_chat(folder, seed=3)
    served = InProcessServer(folder, "tiny")
    with served.client:
        yield served, torch_model, processor


def test_gemma4_answers_as_transformers_generate_and_its_next_turn_reuses_the_cache(gemma4):
    """A 120 x 64 picture (22 x 12 patches, 66 soft tokens between the image begin and end tokens): the answer through
    chat completions (streamed and not) equals transformers' `generate`; the next turn prefills only its new tokens
    and answers as a cold read does; Responses and Messages give the same answer and a forced tool call is valid."""
    torch = require("torch")
    served, torch_model, processor = gemma4
    picture = pictures([(120, 64)])[0]
    plain = [{"role": "user", "content": "\ue000".join(ASK)}]
    ids = served.model.config.expand_images(served.prompt(plain), served.model.image_processor([picture]))
    reference = gemma4_inputs(processor, [picture])
    ids = torch.tensor([ids])
    with torch.no_grad():
        out = torch_model.generate(
            input_ids=ids,
            pixel_values=reference["pixel_values"],
            image_position_ids=reference["image_position_ids"],
            mm_token_type_ids=(ids == CHAT_IMAGE_TOKEN).int(),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    expected = served.tokenizer.decode([t for t in out[0, ids.shape[1] :].tolist() if t != EOS])
    history = [{"role": "user", "content": chat_content(picture)}]
    first = assert_chat_completions_answer(served.openai(), history, expected)
    check_next_turn(served, picture, first, ids.shape[1])
    assert_every_api_answers(served, picture, expected)


def header_only_png(width: int, height: int) -> bytes:
    """A PNG whose header says `width` x `height` (its pixel data a few bytes): a decompression bomb's shape."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")
    )


def bodies(image: bytes | str) -> dict[str, tuple[str, dict]]:
    """(path, body) per API sending `image`: bytes inline (base64), or a URL as it is."""
    inline = base64.b64encode(image).decode() if isinstance(image, bytes) else None
    url = f"data:image/png;base64,{inline}" if inline is not None else image
    chat = [{"type": "text", "text": "What?"}, {"type": "image_url", "image_url": {"url": url}}]
    responses = [{"type": "input_text", "text": "What?"}, {"type": "input_image", "image_url": url}]
    source = {"type": "base64", "media_type": "image/png", "data": inline} if inline else {"type": "url", "url": url}
    anthropic = [{"type": "image", "source": source}, {"type": "text", "text": "What?"}]
    out = {
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": chat}], "max_tokens": 2}),
        "responses": ("/v1/responses", {"input": [{"role": "user", "content": responses}], "max_output_tokens": 2}),
        "messages": ("/v1/messages", {"messages": [{"role": "user", "content": anthropic}], "max_tokens": 2}),
    }
    if inline is not None:
        message = {"role": "user", "content": "What?", "images": [inline]}
        out["ollama"] = ("/api/chat", {"messages": [message], "stream": False, "options": {"num_predict": 2}})
    return out


def refused(served: InProcessServer, image, status: int, *words: str) -> None:
    """Every API answers `status` within 2 s, in its own error shape, its message naming `words`."""
    for api, (path, body) in bodies(image).items():
        started = time.monotonic()
        response = served.client.post(path, json={"model": "tiny", **body})
        took, answer = time.monotonic() - started, response.json()
        assert response.status_code == status and took < 2, (api, response.status_code, took)
        if api == "messages":
            assert answer["type"] == "error" and answer["error"]["type"] in (
                "invalid_request_error",
                "request_too_large",
            )
            message = answer["error"]["message"]
        elif api == "ollama":
            message = answer["error"]
        else:
            message = answer["error"]["message"]
        assert all(word in message for word in words), (api, message)


def test_bad_images_are_refused_in_each_apis_shape_and_the_server_goes_on(gemma3, tmp_path):
    served, *_ = gemma3
    png = io.BytesIO()
    pictures()[0].save(png, "PNG")
    refused(served, b"not a picture at all", 400, "not a readable image")
    refused(served, png.getvalue()[:-40], 400, "not a readable image")
    refused(served, header_only_png(20_000, 20_000), 400, "too many pixels")
    refused(served, header_only_png(9_000, 9_000), 400, "9000 x 9000 pixels")
    refused(served, "http://127.0.0.1:9/cat.png", 400, "does not fetch image URLs", "data URL")
    refused(served, "file:///etc/passwd", 400, "must be an image's data URL")
    refused(served, b"x" * 50_000_000, 413, "larger than")
    content = [{"type": "text", "text": "<start_of_image> and "}, *chat_content(pictures()[0])]  # a place, no image
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    response = served.client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and "2 place(s) for images but 1 image(s)" in response.json()["error"]["message"]
    answer = served.openai().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": chat_content(pictures()[0])}], max_tokens=2
    )
    assert answer.choices[0].finish_reason in ("stop", "length")  # still serving

    write_model(tmp_path / "llama", {"model_type": "llama", **TINY_LLAMA})
    (tmp_path / "llama" / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    text_only = InProcessServer(tmp_path / "llama", "tiny")
    with text_only.client:
        refused(text_only, png.getvalue(), 400, "image input is not supported by this model")
        assert text_only.client.get("/v1/models").json()["data"][0]["input_modalities"] == ["text"]
    assert served.client.get("/v1/models").json()["data"][0]["input_modalities"] == ["text", "image"]


def test_image_limits_are_refused_in_each_apis_shape_and_the_server_goes_on(gemma3):
    """Serve's --max-image-pixels, --max-image-mb and --max-images: each refused (400) within 2 s by every API."""
    served, *_ = gemma3
    from minimlx.server.models import Serving

    limits = ImageLimits(max_pixels=64 * 64, max_bytes=5_000, max_images=1)
    limited = InProcessServer(served.folder, "tiny", Serving(image_limits=limits))
    rng = np.random.default_rng(0)
    noise, wide, small = (io.BytesIO() for _ in range(3))
    Image.fromarray(rng.integers(0, 256, (60, 60, 3), dtype=np.uint8)).save(noise, "PNG")  # 3,600 pixels, > 5 kB
    Image.new("RGB", (120, 40), (200, 30, 90)).save(wide, "PNG")  # 4,800 pixels, a few bytes
    Image.new("RGB", (30, 30), (20, 130, 90)).save(small, "PNG")
    with limited.client:
        refused(limited, noise.getvalue(), 400, "bytes, more than the 5,000 read per image")
        refused(limited, wide.getvalue(), 400, "120 x 40 pixels", "4,096")
        two = chat_content(open_image(small.getvalue())) + chat_content(open_image(small.getvalue()))
        body = {"model": "tiny", "messages": [{"role": "user", "content": two}], "max_tokens": 2}
        response = limited.client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400 and "2 images came, more than the 1" in response.json()["error"]["message"]
        answer = limited.openai().chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": chat_content(open_image(small.getvalue()))}],
            max_tokens=2,
        )
        assert answer.choices[0].finish_reason in ("stop", "length")


class PictureHost(http.server.BaseHTTPRequestHandler):
    """A local HTTP server's pages: /cat.png a picture, /big.png one that says it is 3 MB, /endless.png one that
    never stops (no length given), /slow.png one that answers after 3 s, /redirect.png a redirect to a file URL;
    anything else 404."""

    picture = b""

    def do_GET(self):
        if self.path == "/cat.png":
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.picture)))
            self.end_headers()
            self.wfile.write(self.picture)
        elif self.path == "/big.png":
            self.send_response(200)
            self.send_header("Content-Length", str(3_000_000))
            self.end_headers()
        elif self.path == "/endless.png":
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(100):
                    self.wfile.write(b"x" * 100_000)
            except OSError:
                pass  # the server stopped reading
        elif self.path == "/slow.png":
            time.sleep(3)
            self.send_response(200)
            self.end_headers()
        elif self.path == "/redirect.png":
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd")
            self.end_headers()
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture
def picture_host():
    png = io.BytesIO()
    pictures()[0].save(png, "PNG")
    PictureHost.picture = png.getvalue()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), PictureHost)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_image_urls_are_fetched_with_allow_image_urls_within_their_limits(gemma3, picture_host):
    """With --allow-image-urls (1 MB, 1 s) an http URL's picture answers as its data URL does; an unreachable,
    missing, too large, endless, slow or redirected-to-a-file URL is refused in each API's shape within 2 s."""
    from minimlx.server.images import ImageFetcher
    from minimlx.server.models import Serving

    served, *_ = gemma3
    fetching = InProcessServer(served.folder, "tiny", Serving(image_urls=ImageFetcher(1_000_000, 1.0)))
    with fetching.client:
        expected = served.cold([{"role": "user", "content": "\ue000".join(ASK)}], [pictures()[0]])
        content = [
            {"type": "text", "text": ASK[0]},
            {"type": "image_url", "image_url": {"url": picture_host + "/cat.png"}},
        ]
        content.append({"type": "text", "text": ASK[1]})
        settings = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0)
        answer = fetching.openai().chat.completions.create(messages=[{"role": "user", "content": content}], **settings)
        assert answer.choices[0].message.content == expected
        block = {"type": "image", "source": {"type": "url", "url": picture_host + "/cat.png"}}
        content = [{"type": "text", "text": ASK[0]}, block, {"type": "text", "text": ASK[1]}]
        settings = dict(model="tiny", max_tokens=MAX_TOKENS, extra_body={"temperature": 0})
        message = fetching.anthropic().messages.create(messages=[{"role": "user", "content": content}], **settings)
        assert "".join(b.text for b in message.content) == expected

        refused(fetching, "http://127.0.0.1:9/cat.png", 400, "failed", "data URL")
        refused(fetching, picture_host + "/missing.png", 400, "HTTP 404")
        refused(fetching, picture_host + "/big.png", 413, "larger than 1 MB", "--image-url-mb")
        refused(fetching, picture_host + "/endless.png", 413, "larger than 1 MB")
        refused(fetching, picture_host + "/slow.png", 400, "took more than 1 s")
        refused(fetching, picture_host + "/redirect.png", 400, "not an http(s) URL")
        refused(fetching, "file:///etc/passwd", 400, "must be an image's data URL")
    refused(served, picture_host + "/cat.png", 400, "does not fetch image URLs", "data URL")  # without the flag
