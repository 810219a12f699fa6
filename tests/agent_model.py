"""The model the coding agents' tests run: a tiny random llama with SmolLM2's tokenizer and chat template and 65,536
positions (Claude Code's and Codex's prompts are 6,000-20,000 tokens), whose answers end by themselves.

Its words mean nothing; what matters is that each answer is short and ends with the end-of-text token, as a real
model's does, so that an agent's turn ends normally: every token's embedding carries one large shared coordinate,
which the output head reads into the end-of-text logit, so that at temperature 1 each step ends the answer with a
probability of about END_PROBABILITY whatever the text.
"""

import math
from pathlib import Path

from llamacpp import CACHE, smollm2_tokenizer, staged
from models import smollm2_path

END_PROBABILITY = 0.15
SHARED = 4.0  # the shared coordinate of every token's embedding


def agent_model() -> Path:
    """The model's folder (built once, cached beside llama.cpp's sources)."""
    folder = CACHE.parent / "agent-model"
    if (folder / "model.safetensors").is_file():
        return folder
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer(Path(smollm2_path())))
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=65_536,
        rope_theta=100_000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = SHARED
        # after the final RMSNorm the shared coordinate is about SHARED / rms; the other logits stay near 0, so the
        # end logit that gives END_PROBABILITY against the rest of the vocabulary is log(p / (1 - p) * vocab)
        rms = math.sqrt((SHARED**2 + (config.hidden_size - 1) * 0.02**2) / config.hidden_size)
        end_logit = math.log(END_PROBABILITY / (1 - END_PROBABILITY) * config.vocab_size)
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[tokenizer.eos_token_id, 0] = end_logit / (SHARED / rms)
    with staged(folder) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return folder
