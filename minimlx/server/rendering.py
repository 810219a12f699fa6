"""A chat turn as the model reads it: the chat template over its messages and tools, a forced tool choice as a
grammar of the template's tool-call format, and the parsers that split the reply back into content, reasoning and
tool calls."""

from collections.abc import Callable
from dataclasses import replace

from ..decode.grammar import Constraint
from ..decode.prompt import as_written
from ..errors import MinimlxError
from ..text.replies import ReplyParser, tool_format
from .fields import APIError, bad, unsupported_image
from .images import IMAGE_PLACE
from .turns import ForcedCall, TokenLogprob, Turn, check_tools


class Renderer:
    """Renders turns with the tokenizer's chat template (`chat_template` replaces the model's own); `reasoning`
    splits thinking text from the answer (False keeps it in the content); `forced_call` is serve's
    --force-tool-call; `image_text` is the text of the token an image-text model's prompts write where an image goes
    (None: the model reads text only), and `write_images` writes a prompt's images out as its processor writes them
    in text (`write_images_text`)."""

    def __init__(
        self,
        tokenizer,
        chat_template: str | None,
        reasoning: bool,
        forced_call: ForcedCall | None,
        image_text: str | None = None,
        write_images: Callable[[str], str] = as_written,
    ):
        self.tokenizer, self.reasoning, self.forced_call = tokenizer, reasoning, forced_call
        self.image_text, self.write_images = image_text, write_images
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        self.tool_format = tool_format(tokenizer.chat_template)

    def prepare(self, turn: Turn) -> tuple[Turn, list[int], "callable", bool]:
        """(the turn with its tool choice as its constraint, its prompt ids, a maker of one reply parser, whether
        the --force-tool-call switch made its answer)."""
        switched = self.forced_call is not None and self.forced_call.applies(turn)
        if switched:
            turn = self.forced_call.applied(turn)
        tools = check_tools(turn.tools, turn.tool_choice) if turn.tool_choice != "none" else None
        constraint, forced = turn.constraint, bool(tools) and turn.tool_choice != "auto"
        if forced:
            constraint = Constraint.lark(self.tool_format.grammar(tools, turn.tool_choice, turn.parallel_tool_calls))
        text = self.render(turn)
        prompt = self.prompt_ids(text, turn)

        def parser() -> ReplyParser:
            return ReplyParser(self.tokenizer.chat_template, bool(tools), self.reasoning, text, forced=forced)

        return replace(turn, constraint=constraint), prompt, parser, switched

    def render(self, turn: Turn) -> str:
        """The prompt text of a chat turn: the template over its messages and tools. A final assistant message is
        continued (its text ends the prompt, after the generation prompt). System messages after the first message
        (Claude Code sends them mid-conversation) go to the template as they are; a template that refuses them gets
        them merged, in order, into one leading system message."""
        param = turn.messages_param
        if self.tokenizer.chat_template is None:
            message = (
                "this model has no chat template: start the server with --chat-template FILE (a Jinja chat "
                "template), or send raw text to /v1/completions"
            )
            raise APIError(400, message, param, "no_chat_template")
        messages, prefill = turn.messages, ""
        if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
            if len(messages) > 1 and messages[-2]["role"] == "assistant":
                raise bad(
                    param,
                    "the messages end with two assistant messages; the last one is continued, so "
                    "send at most one at the end",
                )
            messages, prefill = messages[:-1], messages[-1]["content"]
        tools = turn.tools if turn.tool_choice != "none" else None
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, **turn.template_kwargs)
        except MinimlxError as e:
            merged = merged_system(messages)
            if merged is None:
                raise bad(param, str(e)) from None
            try:
                text = self.tokenizer.apply_chat_template(merged, tools=tools, **turn.template_kwargs)
            except MinimlxError:
                raise bad(param, str(e)) from None
        return text + prefill

    def capabilities(self) -> tuple[str, ...]:
        """What the model can do, as Ollama's /api/show names it: every model completes and calls tools (in its
        template's format, or the generic one); thinking where its template thinks."""
        template = self.tokenizer.chat_template or ""
        thinks = "enable_thinking" in template or any(marker in template for marker in self.tool_format.reasoning)
        return ("completion", "tools", *(("thinking",) if thinks else ()))

    def prompt_ids(self, text: str, turn: Turn) -> list[int]:
        """The ids of the turn's rendered `text`, its images' places written in (a text-only model refuses them)."""
        if turn.images and self.image_text is None:
            raise unsupported_image(turn.messages_param)
        if turn.images:
            text = self.write_images(text.replace(IMAGE_PLACE, self.image_text))
        return self.tokenizer.encode(text, add_special_tokens=False)

    def token_logprob(self, token: int, logprob: float, top) -> TokenLogprob:
        """A token's logprob with its text and bytes, and its alternatives' (`top`: (id, logprob) pairs)."""
        text = self.tokenizer.decode([token])
        alternatives = [(self.tokenizer.decode([t]), lp) for t, lp in top]
        return TokenLogprob(text, logprob, list(text.encode()), [(t, lp, list(t.encode())) for t, lp in alternatives])


def merged_system(messages: list[dict]) -> list[dict] | None:
    """`messages` with every system message joined, in order, into one leading system message; None when there
    is no system message after the first message (nothing to merge)."""
    if not any(m["role"] == "system" for m in messages[1:]):
        return None
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system" and m["content"])
    rest = [m for m in messages if m["role"] != "system"]
    return ([{"role": "system", "content": system}] if system else []) + rest
