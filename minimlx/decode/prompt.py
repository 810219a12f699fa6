"""What generation continues: a prompt as text or token ids, the ids checked against the model's vocabulary.

An id outside the vocabulary would read past the embedding (a crash, or a silent wrap), so each is checked
before any work is done (InvalidSettingError naming it); `trace` checks its ids the same way.
"""

from collections.abc import Callable, Sequence

from ..errors import InvalidSettingError
from .settings import whole


def vocab_size(model) -> int | None:
    """The size of a model's token embedding, as its plugin config states it (None when it does not)."""
    return getattr(getattr(model, "config", None), "vocab_size", None)


def check_ids(ids, vocab_size: int | None) -> list[int]:
    """`ids` (a sequence or 1-d array of token ids) as a list of ints, each in [0, vocab_size)."""
    if isinstance(ids, (str, bytes, bytearray)) or not hasattr(ids, "__iter__"):
        kind = "bytes; decode them to text first" if isinstance(ids, (bytes, bytearray)) else type(ids).__name__
        raise InvalidSettingError(f"the prompt must be text or a sequence of token ids, not {kind}")
    values = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if not values:
        raise InvalidSettingError("the prompt is empty (no token ids); give at least one token")
    for token in values:
        if not whole(token):
            raise InvalidSettingError(f"token ids must be whole numbers, got {token!r}")
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise InvalidSettingError(f"token id {token} is outside the model's vocabulary (0 to {vocab_size - 1})")
    return [int(token) for token in values]


def check_prompt(prompt, vocab_size: int | None) -> str | list[int]:
    """A prompt as generation takes it: text as it is, token ids checked by `check_ids`."""
    return prompt if isinstance(prompt, str) else check_ids(prompt, vocab_size)


def as_written(text: str) -> str:
    return text


def encode_prompt(
    tokenizer,
    prompt: str | Sequence[int],
    chat_template: bool = True,
    system: str | None = None,
    write_images: Callable[[str], str] = as_written,
):
    """Token ids of the prompt: ids pass through; text goes through the chat template when the model has one, then
    `write_images` (a prompt holding images: the family's `write_images_text`), as a processor tokenizes it."""
    if not isinstance(prompt, str):
        return list(prompt)
    if system is not None and not chat_template:
        raise InvalidSettingError("a system prompt needs the chat template; drop --no-chat-template or --system")
    if chat_template and (tokenizer.chat_template is not None or system is not None):
        system_message = [{"role": "system", "content": system}] if system is not None else []
        messages = system_message + [{"role": "user", "content": prompt}]
        return tokenizer.encode(write_images(tokenizer.apply_chat_template(messages)), add_special_tokens=False)
    return tokenizer.encode(write_images(prompt))


def encode_prefix(tokenizer, text: str, chat_template: bool = True, system: str | None = None) -> list[int]:
    """The token ids a prompt starting with `text` begins with (`minimlx cache-prompt`): through the chat template,
    the system turn and a user turn of `text` (either may be missing), cut where the last of them ends; else
    `text` as it is."""
    if not text and system is None:
        raise InvalidSettingError("nothing to cache; give a text or a system prompt")
    if not chat_template or (tokenizer.chat_template is None and system is None):
        return encode_prompt(tokenizer, text, False, system)
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages += [{"role": "user", "content": text}] if text else []
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    last = messages[-1]["content"].strip()
    end = rendered.rfind(last) + len(last) if last in rendered else len(rendered)
    return tokenizer.encode(rendered[:end], add_special_tokens=False)


def prompt_ids(
    model, tokenizer, prompt, chat_template: bool = True, system: str | None = None, images: bool = False
) -> list[int]:
    """The checked token ids generation continues, from text or ids; text holding `images` written out as the
    model's processor writes it (`write_images_text`)."""
    vocab = vocab_size(model)
    write = model.config.write_images_text if images else as_written
    return check_ids(encode_prompt(tokenizer, check_prompt(prompt, vocab), chat_template, system, write), vocab)
