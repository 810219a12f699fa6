"""Chat templates rendered the way Hugging Face transformers renders them.

Templates are Jinja written for transformers' sandbox: `trim_blocks`/`lstrip_blocks`, a `tojson` that keeps
non-ASCII text, `raise_exception`, `strftime_now`, loop controls and `{% generation %}` blocks.
"""

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import InvalidSettingError


class GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlocks, loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return environment.from_string(source)


def render_chat(source: str, messages: list[dict], add_generation_prompt: bool, **special_tokens) -> str:
    """The prompt text for `messages`; `special_tokens` (bos_token, eos_token) are template variables."""
    try:
        return compile_template(source).render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
        )
    except Exception as error:  # a template is a program: any error in it is the template's, not minimlx's
        reason = " ".join(str(error).split())
        reason = reason if isinstance(error, jinja2.TemplateError) else f"{type(error).__name__}: {reason}"
        raise InvalidSettingError(
            f"The model's chat template failed: {reason}; check the messages' roles and order, "
            "or pass --no-chat-template to send the prompt as raw text"
        ) from None
