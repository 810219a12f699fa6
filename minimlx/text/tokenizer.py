"""The tokenizer generation uses: a `tokenizers.Tokenizer` plus special ids, the chat template and streaming."""

from pathlib import Path

from tokenizers import Tokenizer as Backend
from tokenizers import processors

from ..errors import CheckpointError, InvalidSettingError
from ..io.config import read_json
from .chat import chat_messages_for_template, render_chat
from .detokenizer import ByteDetokenizer, RedecodingDetokenizer, byte_table
from .gguf_vocab import read_vocab
from .tool_formats import tool_format


class Tokenizer:
    def __init__(
        self,
        backend: Backend,
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: set[int],
        chat_template: str | None,
        encoder: Backend | None = None,
    ):
        self.backend = backend
        self.encoder = encoder or backend  # a GGUF vocabulary's own encoding, where tokenizer.json cannot say it
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        named_eos = {backend.token_to_id(eos_token)} if eos_token else set()
        self.eos_token_ids = {token_id for token_id in named_eos | set(eos_token_ids) if token_id is not None}
        self.chat_template = chat_template
        self._byte_tables = {}

    @classmethod
    def from_folder(cls, path) -> "Tokenizer":
        """From tokenizer.json plus tokenizer_config.json, chat_template.jinja, generation_config.json when present."""
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise CheckpointError(
                f"{folder} has no tokenizer.json; copy it from the model's Hugging Face repository into the folder"
            )
        try:
            backend = Backend.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # tokenizers raises plain Exceptions
            reason = " ".join(str(e).split())
            path = folder / "tokenizer.json"
            raise CheckpointError(f"{path} is not a valid tokenizer ({reason}); re-download it") from None
        config = read_json(folder / "tokenizer_config.json", missing={})
        bos_token, eos_token = _content(config.get("bos_token")), _content(config.get("eos_token"))
        # Like transformers: explicit add_bos/add_eos flags (or no post-processor at all) replace tokenizer.json's.
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            add_special_tokens(
                backend,
                bos_token if config.get("add_bos_token") else None,
                eos_token if config.get("add_eos_token") else None,
            )
        generation_eos = read_json(folder / "generation_config.json", missing={}).get("eos_token_id")
        template_file = folder / "chat_template.jinja"
        chat_template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if isinstance(chat_template, list):  # several named templates: generation uses the default one
            named = {e.get("name"): e.get("template") for e in chat_template if isinstance(e, dict)}
            chat_template = named.get("default")
        eos_ids = set(generation_eos) if isinstance(generation_eos, list) else {generation_eos} - {None}
        if not isinstance(chat_template, (str, type(None))) or not all(type(i) is int for i in eos_ids):
            raise CheckpointError(
                f"{folder} holds a chat template that is not text, or an eos_token_id that is not a token id; "
                "re-download it"
            )
        return cls(backend, bos_token, eos_token, eos_ids, chat_template)

    @classmethod
    def from_gguf(cls, metadata: dict) -> "Tokenizer":
        """From a GGUF file's metadata, as `mx.load(path, return_metadata=True)[1]` returns it."""
        vocab = read_vocab(metadata)
        for backend in (vocab.backend, vocab.encoder):
            add_special_tokens(
                backend,
                vocab.bos_token if vocab.add_bos_token else None,
                vocab.eos_token if vocab.add_eos_token else None,
            )
        return cls(
            vocab.backend, vocab.bos_token, vocab.eos_token, vocab.end_token_ids, vocab.chat_template, vocab.encoder
        )

    @property
    def vocab_size(self) -> int:
        """How many ids the tokenizer knows, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        """The id of the vocabulary's token `token` (a special token's text, say), or None where it has none."""
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encoder.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = True,
        **variables,
    ) -> str:
        """The prompt for OpenAI-shaped `messages` and `tools`; `variables` (chat_template_kwargs such as
        enable_thinking) reach the template. With `add_generation_prompt` False a final assistant message is
        continued: the prompt ends where its content does (as transformers' continue_final_message), unless
        `continue_final_message` is False (a finished conversation, its end-of-turn marker kept: training data)."""
        if self.chat_template is None:
            raise InvalidSettingError(
                "This model has no chat template; pass --no-chat-template to send the prompt as raw text"
            )
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        messages, tools = tool_format(self.chat_template).template_input(chat_messages_for_template(messages), tools)
        prompt = render_chat(
            self.chat_template,
            messages,
            add_generation_prompt,
            tools,
            **{name: token for name, token in special.items() if token},
            **variables,
        )
        final = messages[-1] if messages else {}
        if add_generation_prompt or not continue_final_message or final.get("role") != "assistant":
            return prompt
        if not isinstance(final.get("content"), str):
            return prompt
        content = final["content"].strip()
        return prompt[: prompt.rindex(content) + len(content)] if content in prompt else prompt

    def detokenizer(self, skip_special_tokens: bool = False):
        """A streaming decoder: `add(token_id)` returns the text that token completes, `finalize()` the rest."""
        if skip_special_tokens not in self._byte_tables:
            self._byte_tables[skip_special_tokens] = byte_table(self.backend, skip_special_tokens)
        table = self._byte_tables[skip_special_tokens]
        if table is None:
            return RedecodingDetokenizer(self.backend, skip_special_tokens)
        return ByteDetokenizer(*table)


def add_special_tokens(backend: Backend, bos_token: str | None, eos_token: str | None) -> None:
    """Make `encode(..., add_special_tokens=True)` put `bos_token` first and `eos_token` last (either may be None)."""
    single = " ".join([f"{bos_token}:0"] * bool(bos_token) + ["$A:0"] + [f"{eos_token}:0"] * bool(eos_token))
    pair = " ".join([single] + [f"{bos_token}:1"] * bool(bos_token) + ["$B:1"] + [f"{eos_token}:1"] * bool(eos_token))
    named = dict.fromkeys(token for token in (bos_token, eos_token) if token)
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(token, backend.token_to_id(token)) for token in named]
    )


def _content(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with `content`."""
    token = token.get("content") if isinstance(token, dict) else token
    return token if isinstance(token, str) else None
