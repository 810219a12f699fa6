"""The settings of one generation: listed and checked here, once, for every caller.

`minimlx run`/`chat` options, `stream_generate`'s keyword arguments and the HTTP fields of `minimlx serve` all
become one `SamplingSettings`; what it refuses raises InvalidSettingError naming the value and what is allowed,
before any work is done.
"""

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from ..core.sampling import Sampler, make_sampler
from ..errors import InvalidSettingError
from .grammar import Constraint

SEEDS = 2**64  # mx.random.key takes seeds in [0, 2**64)
MAX_BIAS = 100  # OpenAI's bound: -100 all but bans a token, +100 all but forces it
MAX_LOGPROBS = 20  # alternatives a token's logprobs may list


def whole(value) -> bool:
    """An integer (Python's or NumPy's), and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_whole(name: str, value, low: int, high: int | None = None) -> None:
    """Refuse `value` unless it is a whole number in [low, high]."""
    if not whole(value) or value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f">= {low}"
        raise InvalidSettingError(f"{name} must be a whole number {span}, got {value!r}", field=name)


def checked_bias(logit_bias) -> tuple[tuple[int, float], ...]:
    """`logit_bias` (a mapping or pairs of token id -> bias) as sorted (id, bias) pairs, each id a whole number
    >= 0 given once and each bias a finite number in [-MAX_BIAS, MAX_BIAS]."""
    pairs = logit_bias.items() if isinstance(logit_bias, Mapping) else logit_bias
    try:
        pairs = [(token, bias) for token, bias in pairs]
    except (TypeError, ValueError):
        raise InvalidSettingError(
            f"logit_bias must map token ids to biases (a dict or (id, bias) pairs), got {logit_bias!r}",
            field="logit_bias",
        ) from None
    for token, bias in pairs:
        if not whole(token) or token < 0:
            raise InvalidSettingError(f"a logit_bias token id must be a whole number >= 0, got {token!r}", "logit_bias")
        real = isinstance(bias, numbers.Real) and not isinstance(bias, bool) and math.isfinite(bias)
        if not real or abs(bias) > MAX_BIAS:
            raise InvalidSettingError(
                f"the logit_bias of token {token} must be a number from -{MAX_BIAS} to {MAX_BIAS}, got {bias!r}",
                field="logit_bias",
            )
    ids = [int(token) for token, _ in pairs]
    if len(set(ids)) < len(ids):
        twice = next(token for token in ids if ids.count(token) > 1)
        raise InvalidSettingError(f"logit_bias gives token {twice} more than one bias; give each id once", "logit_bias")
    return tuple(sorted((int(token), float(bias)) for token, bias in pairs))


@dataclass(frozen=True)
class SamplingSettings:
    """How one sequence is generated.

    `max_tokens` bounds the answer (the model's context may end it sooner). `temperature` 0 is greedy; above it,
    `top_k`, `top_p` and `min_p` filter the distribution a token is drawn from (0, 1 and 0 keep every token), and
    `seed` makes the draws reproducible. `repetition_penalty` above 1 makes tokens of the prompt and the answer
    less likely. `stop` strings end the answer before them: one string, or several (kept as a tuple).

    `constraint` is a grammar the answer must match (`Constraint.json_schema(...)`, `.regex(...)`, ...).
    `logit_bias` adds a bias to the logits of some token ids before anything else (a dict id -> bias, kept as
    sorted pairs). `logprobs` k asks for each token's log-probability under the model (before bias, grammar
    and temperature) and its k most likely alternatives (0 to 20; None: none).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = ()
    constraint: Constraint | None = None
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] = ()
    logprobs: int | None = None

    def __post_init__(self):
        check_whole("max_tokens", self.max_tokens, 1)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise InvalidSettingError(
                f"constraint must be a Constraint (Constraint.json_schema(...), ...), "
                f"got {type(self.constraint).__name__}",
                field="constraint",
            )
        object.__setattr__(self, "logit_bias", checked_bias(self.logit_bias if self.logit_bias is not None else ()))
        if self.logprobs is not None:
            check_whole("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.seed is not None:
            check_whole("seed", self.seed, 0, SEEDS - 1)
        stops = [self.stop] if isinstance(self.stop, str) else [] if self.stop is None else self.stop
        if not isinstance(stops, Sequence) or not all(isinstance(s, str) and s for s in stops):
            raise InvalidSettingError(
                f"stop must be a string or a list of non-empty strings, got {self.stop!r}", "stop"
            )
        object.__setattr__(self, "stop", tuple(stops))
        reals = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        for name, value in reals.items():
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidSettingError(f"{name} must be a finite number, got {value!r}", field=name)
        if not whole(self.top_k):
            raise InvalidSettingError(f"top_k must be a whole number, got {self.top_k!r}", field="top_k")
        problems = [
            (self.temperature < 0, "temperature", f"temperature must be >= 0 (0 is greedy), got {self.temperature}"),
            (not 0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1] (1 keeps every token), got {self.top_p}"),
            (self.top_k < 0, "top_k", f"top_k must be >= 0 (0 keeps every token), got {self.top_k}"),
            (not 0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1] (0 keeps every token), got {self.min_p}"),
            (
                self.repetition_penalty <= 0,
                "repetition_penalty",
                f"repetition_penalty must be > 0 (1 is no penalty), got {self.repetition_penalty}",
            ),
        ]
        for bad, name, message in problems:
            if bad:
                raise InvalidSettingError(message, field=name)

    @property
    def greedy(self) -> bool:
        """Whether each token is the logits' argmax alone (no penalty, no bias, no draw)."""
        return self.temperature == 0 and self.repetition_penalty == 1.0 and not self.logit_bias

    def sampler(self) -> Sampler:
        return make_sampler(self.temperature, self.top_p, self.top_k, self.min_p)


NAMES = frozenset(f.name for f in fields(SamplingSettings))


def sampling_settings(settings: SamplingSettings | None, keywords: dict) -> SamplingSettings:
    """The settings a caller gave: a `SamplingSettings`, or its fields as keyword arguments
    (`stream_generate(..., max_tokens=32, temperature=0.7)`), not both."""
    if settings is None:
        return SamplingSettings(**keywords)
    if keywords:
        raise InvalidSettingError(f"give settings= or the settings {', '.join(sorted(keywords))} by name, not both")
    return settings


KV_BITS = (4, 8)
"""The widths a quantized KV cache holds its codes in (those the native attention reads)."""


def check_kv_bits(kv_bits: int | None) -> None:
    if kv_bits is not None and kv_bits not in KV_BITS:
        raise InvalidSettingError(f"kv_bits is {kv_bits}; a quantized KV cache holds 8 or 4 bits (or None: float)")
