"""What the fine-tuning tests train on: a word-level tokenizer with a chat template that marks turns, a tiny random
llama built by minimlx itself (no torch: milliseconds), saved as a Hugging Face folder, and JSONL data files."""

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from minimlx.archs import build_model
from minimlx.text import Tokenizer

WORDS = 64
# user turns, then assistant turns, each ended by w2; the generation prompt opens an assistant turn
TEMPLATE = (
    "{% if tools %}tools {% for tool in tools %}{{ tool['name'] }} {% endfor %}w2 {% endif %}"
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} w2 {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
MOE = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
CONFIG = dict(
    model_type="llama",
    vocab_size=WORDS,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def word_backend() -> Backend:
    """Words w0..w63 (w0 unknown: roles and other words read as it), split at whitespace."""
    backend = Backend(models.WordLevel({f"w{i}": i for i in range(WORDS)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return backend


def word_tokenizer(template: str | None = TEMPLATE) -> Tokenizer:
    return Tokenizer(word_backend(), None, "w1", set(), template)


def tiny_llama(folder: Path, seed: int = 0, **changes) -> Path:
    """A random 3-block llama over the words (`changes` to its config: MOE makes it a mixture of experts), with the
    chat template, as a Hugging Face folder."""
    config = {**CONFIG, **changes}
    mx.random.seed(seed)
    model = build_model(config)
    # stacked experts start at zero: drawn as MLX draws a linear map's weights instead (bound 1 / sqrt(inputs))
    experts = [(k, v) for k, v in tree_flatten(model.parameters()) if ".experts." in k and k.endswith("weight")]
    model.update(tree_unflatten([(k, mx.random.uniform(-1, 1, v.shape) * v.shape[-1] ** -0.5) for k, v in experts]))
    mx.eval(model.parameters())
    folder.mkdir(parents=True, exist_ok=True)
    weights = model.config.names.to_theirs(dict(tree_flatten(model.parameters())))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    word_backend().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


def chat(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def write_jsonl(path: Path, records: list) -> Path:
    """`records` one a line (a string is written as it is: a malformed line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def copy_task(folder: Path, train: int = 48, valid: int = 8, seed: int = 0) -> Path:
    """A data folder teaching the tiny model to answer a question of three words with w3 and the first of them (the
    tiny model's bracketed answers: w3 is quickly learned, the copy slowly)."""
    import random

    rng = random.Random(seed)
    records = []
    for _ in range(train + valid):
        words = [f"w{rng.randrange(3, WORDS)}" for _ in range(3)]
        records.append(chat(" ".join(words), f"w3 {words[0]}"))
    write_jsonl(folder / "train.jsonl", records[:train])
    write_jsonl(folder / "valid.jsonl", records[train:])
    return folder
