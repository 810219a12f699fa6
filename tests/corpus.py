"""Texts the tokenizers are checked on: scripts, code, numbers, emoji, odd whitespace, chat markup, contractions."""

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see!",
    "机器学习是人工智能的一个分支。你好，世界！",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))",
    "1234567 89 3.14159 2024-06-01 1,000,000",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷!",
    "a   b\n\n\t c  \n   \r\n end   ",
    "¿Qué tal? «Très bien» — naïve café… (ok) [x] {y} <z> @#$%^&*",
    "<|im_start|>user\nhi<|im_end|>\n",
    "don'T YOU'LL I'M shouldn't've",
]
