"""One model across several processes, over `mx.distributed`: a pipeline, or tensor parallelism.

Plugins and core never learn about ranks. The plugin builds the whole model, lazily, and loading checks
every tensor against it; then `Split.shard` cuts the model and the checkpoint's still unread tensors down
to this rank's share, so that only those are read and installed, and `Split.join` puts in the few modules
that talk to the other ranks and wraps the model so that every rank goes on with the same tokens.

- Pipeline (`--pipeline`): rank r holds one contiguous range of blocks, balanced by bytes
  (`distributed.placement.balance`); the first rank also holds the embedding, the last the final norm and the
  head. The hidden state passes rank to rank with `send`/`recv` through the slots of the one loop: on a
  later rank the embedding's slot receives it, on an earlier one the final norm's slot sends it on and the
  head's slot scores nothing. The last rank samples; one `all_sum` gives its token to every rank.
- Tensor parallel (`--tensor-parallel`): each rank holds some of every attention's KV heads (with their
  query heads; latent attention by heads), some of every FFN's hidden columns, some of every MoE's experts.
  Each sub-layer then returns a partial sum, completed by one `all_sum` per sub-layer. Embedding, norms,
  routers and head are replicated; rank 0's token is everyone's.

Before any tensor is read, the ranks compare a digest of config, tensor names, shapes and dtypes, and refuse
to start when they differ (or when a rank's share does not fit its machine). A rank that dies makes the
others' next collective fail (`peer_lost`). `serve` runs a `Mirrored` engine: requests reach rank 0, which
tells the other ranks at each step what joined and left the batch.
"""

import hashlib
import json
import os
import re
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from functools import cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..core.attention import Attention
from ..core.ffn import MLP, SwiGLU
from ..core.latent_attention import LatentAttention
from ..core.moe import MoE
from ..decode import Engine, Generation, Output, Request, SamplingSettings
from ..decode.grammar import Constraint
from ..errors import CheckpointError, InvalidSettingError
from .placement import BEFORE, balance, section_bytes

MODES = ("pipeline", "tensor")
HIDDEN_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
LAUNCH = "start every rank with mlx.launch, e.g. mlx.launch -n 2 --backend ring -- minimlx run --pipeline ..."


@cache
def world() -> mx.distributed.Group:
    """The group of processes started together (by `mlx.launch`); InvalidSettingError for a process alone."""
    try:
        return mx.distributed.init(strict=True)
    except RuntimeError as e:
        raise InvalidSettingError(f"this process was not started as one rank of a group ({e}); {LAUNCH}") from None


def rank_zero_speaks() -> None:
    """Only rank 0 writes output, statistics, warnings and errors. On every rank the backend's own C++ messages
    (one per socket when a peer is lost) are silenced: the error that follows says it in one line."""
    quiet = os.open(os.devnull, os.O_WRONLY)
    sys.stderr.flush()
    if world().rank() == 0:
        sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
    else:
        sys.stdout.flush()
        os.dup2(quiet, 1)
        sys.stderr = open(os.devnull, "w")
        warnings.simplefilter("ignore")
    os.dup2(quiet, 2)


def peer_lost(error: RuntimeError) -> str | None:
    """The one-line message for a collective that failed because another rank stopped, else None."""
    if not re.match(r"\[(ring|jaccl|mpi|nccl)\]", str(error)):
        return None
    return (
        f"another rank stopped or its connection broke ({error}); this rank cannot go on alone: "
        "see that rank's output, then start every rank again"
    )


def memory_bytes() -> int:
    """What this machine can hold: the GPU's recommended working set where there is one, else physical memory."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (
        mx.device_info().get("max_recommended_working_set_size", physical)
        if mx.default_device() == mx.gpu
        else physical
    )


def shares(total: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """`total` split into `parts` contiguous (start, stop) ranges as even as whole multiples of `unit` allow."""
    unit = unit if total % unit == 0 else 1
    units = total // unit
    return [(r * units // parts * unit, (r + 1) * units // parts * unit) for r in range(parts)]


def narrow(weights: dict[str, mx.array], module: str, start: int, stop: int, total: int, axis: int) -> None:
    """Keep [start, stop) of the `total` output rows (axis -2), input columns (-1) or heads or experts (0) of every
    tensor of `module` in `weights`. Packed tensors are cut in proportion, which must fall on whole groups; a
    bias follows the rows and is kept whole otherwise. Each part is copied out (the native kernel reads packed
    weights as contiguous rows, and a view would keep the whole tensor in memory)."""
    for name in [n for n in weights if n.rpartition(".")[0] == module]:
        w = weights[name]
        ax = axis if not name.endswith(".bias") else -1 if axis == -2 else None
        if ax is None:
            continue
        size = w.shape[ax]
        if start * size % total or stop * size % total:
            raise InvalidSettingError(
                f"tensor {name} cannot be split at {start}..{stop} of {total} without cutting a quantization group; "
                "load it as floats (--dtype float32) or use --pipeline"
            )
        index = [slice(None)] * w.ndim
        index[ax] = slice(start * size // total, stop * size // total)
        weights[name] = mx.contiguous(w[tuple(index)])  # its own buffer: not a view holding the whole tensor


class Received(nn.Module):
    """The embedding's slot on a later pipeline rank: the hidden state the previous rank sent, instead of
    embedding the ids. The last rank of a tied model keeps the embedding as `table`, for its head."""

    def __init__(self, dims: int, dtype: mx.Dtype, source: int, group, table: nn.Module | None = None):
        super().__init__()
        self.dims, self.dtype, self.source, self.group = dims, dtype, source, group
        if table is not None:
            self.table = table

    def __call__(self, ids: mx.array) -> mx.array:
        return mx.distributed.recv((*ids.shape, self.dims), self.dtype, self.source, group=self.group)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.table.as_linear(x)


class Sent(nn.Module):
    """The final norm's slot on an earlier pipeline rank: the hidden state goes on, as it is, to the next rank."""

    def __init__(self, target: int, group):
        super().__init__()
        self.target, self.group = target, group

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.send(x, self.target, group=self.group)


class Summed(nn.Module):
    """A sub-layer of which each rank computes part of a sum: the parts added across the group (one all_sum)."""

    def __init__(self, part: nn.Module, group):
        super().__init__()
        self.part, self.group = part, group

    def __call__(self, *args) -> mx.array:
        return mx.distributed.all_sum(self.part(*args), group=self.group)

    def make_cache(self):
        return self.part.make_cache()


class ExpertRange(nn.Module):
    """This rank's experts `first` .. `first + count - 1` of a routed-experts module. A token's choices held by
    other ranks give zeros here; those ranks add theirs in the sub-layer's all_sum."""

    def __init__(self, experts: nn.Module, first: int, count: int):
        super().__init__()
        self.experts, self.first, self.count = experts, first, count

    def __call__(self, x: mx.array, expert_indices: mx.array, per_choice: bool = False) -> mx.array:
        local = expert_indices.astype(mx.int32) - self.first
        held = (local >= 0) & (local < self.count)
        out = self.experts(x, mx.where(held, local, 0).astype(mx.uint32), per_choice)
        return out * held[..., None].astype(out.dtype)


class Distributed(nn.Module):
    """This rank's part of a model split across a group; called, cached and sampled like the whole model.

    An earlier pipeline rank has no scores to give: it returns zeros that depend on its send, and `agree`
    hands every rank the token of the rank that sampled for real. `tensors` names the checkpoint tensors
    (in the whole model's names) this rank read.
    """

    def __init__(self, model: nn.Module, split: "Split"):
        super().__init__()
        self.model, self.config, self.group = model, model.config, split.group
        self.rank, self.size, self.mode = split.rank, split.size, split.mode
        self.tensors = frozenset(split.tensors)
        self.source = self.size - 1 if self.mode == "pipeline" else 0
        self.hands_on = self.mode == "pipeline" and self.rank < self.size - 1
        self.watchdog = Watchdog(float(os.environ.get("MINIMLX_RANK_TIMEOUT", RANK_TIMEOUT)))

    def step_guard(self):
        """What an engine step runs under: a step left waiting on another rank too long ends this process."""
        return self.watchdog.guard()

    def __call__(self, ids: mx.array, cache: list | None = None, last_only: bool = False) -> mx.array:
        out = self.model(ids, cache, last_only=last_only)
        if not self.hands_on:
            return out
        mx.async_eval(out)  # the send goes now, even where nobody reads this rank's scores (a prompt's prefill)
        return mx.depends(mx.zeros((*out.shape[:2], self.config.vocab_size)), out)

    def make_cache(self) -> list:
        return self.model.make_cache()

    def agree(self, tokens: mx.array) -> mx.array:
        """Every rank's `tokens` replaced by those of the sampling rank (the last of a pipeline, else rank 0).

        The other ranks add their own tokens times 0, not fresh zeros: their all_sum must come after the step's
        other collectives, as on the sampling rank, or the ranks would wait for each other in a different order.
        """
        mine = tokens.astype(mx.int32) * int(self.rank == self.source)
        return mx.distributed.all_sum(mine, group=self.group).astype(tokens.dtype)


RANK_TIMEOUT = 45  # seconds one engine step may wait on the other ranks (MINIMLX_RANK_TIMEOUT)


class Watchdog:
    """Ends this process (status 1, one line) when a guarded stretch runs past `seconds`: a rank stopped (SIGSTOP,
    a hung machine) keeps its connections open, so the others' collectives would wait forever, not fail."""

    def __init__(self, seconds: float):
        self.seconds, self.depth, self.since = seconds, 0, 0.0
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    @contextmanager
    def guard(self):
        with self.lock:
            self.depth += 1
            if self.depth == 1:
                self.since = time.monotonic()
            if self.thread is None:
                self.thread = threading.Thread(target=self.watch, name="minimlx-rank-watchdog", daemon=True)
                self.thread.start()
        try:
            yield
        finally:
            with self.lock:
                self.depth -= 1

    def watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.seconds / 4))
            with self.lock:
                late = self.depth and time.monotonic() - self.since > self.seconds
            if late:
                sys.stderr.write(
                    f"error: a step waited over {self.seconds:g} s for the other ranks: one of them is stopped or "
                    "hung (MINIMLX_RANK_TIMEOUT sets the wait); see that rank, then start every rank again\n"
                )
                sys.stderr.flush()
                os._exit(1)


class Split:
    """How this rank of `world()` cuts a model: `shard` before its tensors are installed, `join` after."""

    def __init__(self, mode: str):
        if mode not in MODES:
            raise InvalidSettingError(f"unknown parallel mode {mode!r}; use one of {', '.join(MODES)}")
        self.mode, self.group = mode, world()
        self.rank, self.size = self.group.rank(), self.group.size()
        self.tensors: list[str] = []
        self.experts: list[tuple[int, int] | None] = []  # tensor parallel: each layer's expert range, if MoE

    def shard(
        self, model: nn.Module, weights: dict[str, mx.array], dtype: mx.Dtype | None = None
    ) -> tuple[nn.Module, dict[str, mx.array]]:
        """This rank's part of `model` (built, not loaded) and the (unread) tensors it needs, under its names;
        `dtype` is the one floating tensors will be cast to when installed."""
        self.check_same(model, weights)
        if self.mode == "pipeline":
            weights = self.take_blocks(model, weights)
        else:
            for i, layer in enumerate(model.layers):
                self.take_attention(layer.attn, f"layers.{i}.attn", weights)
                self.experts.append(self.take_ffn(layer.ffn, f"layers.{i}.ffn", weights))
            self.tensors = sorted(weights)
        self.check_room(weights, dtype)
        return model, weights

    def join(self, model: nn.Module) -> Distributed:
        """The loaded part, with the modules that talk to the other ranks put in."""
        if self.mode == "pipeline":
            self.link_stages(model)
        else:
            for layer, experts in zip(model.layers, self.experts):
                if experts is not None:
                    layer.ffn.experts = ExpertRange(layer.ffn.experts, experts[0], experts[1] - experts[0])
                layer.attn, layer.ffn = Summed(layer.attn, self.group), Summed(layer.ffn, self.group)
        return Distributed(model, self)

    def check_same(self, model: nn.Module, weights: dict[str, mx.array]) -> None:
        """Refuse, before a tensor is read, ranks that hold different models or were asked to split differently."""
        signature = (
            self.mode,
            repr(model.config),
            sorted((n, tuple(w.shape), str(w.dtype)) for n, w in weights.items()),
        )
        digest = np.frombuffer(hashlib.sha256(repr(signature).encode()).digest(), dtype=np.int32)
        rows = mx.distributed.all_gather(mx.array(digest)[None], group=self.group).tolist()
        differ = [r for r, row in enumerate(rows) if row != rows[0]]
        if differ:
            raise CheckpointError(
                f"rank {differ[0]} loaded a different model than rank 0 (config, tensor names, shapes or dtypes, "
                "or --pipeline/--tensor-parallel differ); give every rank the same model files and flags"
            )

    def check_room(self, weights: dict[str, mx.array], dtype: mx.Dtype | None) -> None:
        """Refuse, before a tensor is read, a share some rank's machine cannot hold: every rank learns of it, so
        that rank 0 can say which."""
        floats = dtype.size if dtype is not None else None
        needed = sum(
            w.size * (floats or w.dtype.size) if mx.issubdtype(w.dtype, mx.floating) else w.nbytes
            for w in weights.values()
        )
        megabytes = mx.array([[needed / 1e6, memory_bytes() / 1e6]])
        for rank, (need, room) in enumerate(mx.distributed.all_gather(megabytes, group=self.group).tolist()):
            if need > room:
                raise InvalidSettingError(
                    f"rank {rank}'s share of the model needs {need / 1e3:.2f} GB of weights but its machine has "
                    f"{room / 1e3:.2f} GB; split it over more ranks (minimlx anatomy MODEL --ranks N --memory GB "
                    "shows the plan) or load it quantized"
                )

    def take_blocks(self, model: nn.Module, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Pipeline: this rank's range of blocks (renumbered from 0), and the embedding or head if it holds them."""
        before, blocks, after = section_bytes(weights.items(), len(model.layers), model.tied_head)
        self.span = balance(blocks, self.size, before, after)[self.rank]
        first, last = self.rank == 0, self.rank == self.size - 1

        def mine(name: str) -> bool:
            top, _, rest = name.partition(".")
            if top == "layers":
                return int(rest.partition(".")[0]) in self.span
            if top in BEFORE:
                return first or (last and model.tied_head and top == "embed")
            return last

        self.tensors = sorted(name for name in weights if mine(name))
        self.dims = model.norm.weight.shape[-1]
        kept = {}
        for name in self.tensors:
            top, _, rest = name.partition(".")
            if top == "layers":
                layer, _, rest = rest.partition(".")
                kept[f"layers.{int(layer) - self.span.start}.{rest}"] = weights.pop(name)
            else:
                kept[name] = weights.pop(name)
        weights.clear()  # the other ranks' tensors: never read
        model.layers = model.layers[self.span.start : self.span.stop]
        return kept

    def link_stages(self, model: nn.Module) -> None:
        """Pipeline: receive in the embedding's slot (all but the first rank), send in the final norm's (all but
        the last), after agreeing on the hidden state's dtype (the first rank's embedding output)."""
        first, last = self.rank == 0, self.rank == self.size - 1
        code = HIDDEN_DTYPES.index(model.embed(mx.zeros((1, 1), mx.int32)).dtype) if first else 0
        dtype = HIDDEN_DTYPES[mx.distributed.all_sum(mx.array(code), group=self.group).item()]
        if not first:
            table = model.embed if last and model.tied_head else None
            model.embed = Received(self.dims, dtype, self.rank - 1, self.group, table)
            model.pop("positions", None)
        if not last:
            model.norm = Sent(self.rank + 1, self.group)
            model.head = nn.Identity()

    def take_attention(self, attn: nn.Module, path: str, weights: dict[str, mx.array]) -> None:
        """Tensor parallel: this rank's heads of an attention (KV heads with their query heads)."""
        if isinstance(attn, Attention):
            if "q_norm" in attn and not attn.qk_norm_per_head:
                raise InvalidSettingError("this model normalises all query heads together; use --pipeline")
            self.check_enough(attn.kv_heads, "KV heads")
            kv_start, kv_stop = shares(attn.kv_heads, self.size)[self.rank]
            group, d = attn.heads // attn.kv_heads, attn.head_dim
            narrow(weights, f"{path}.q_proj", kv_start * group * d, kv_stop * group * d, attn.heads * d, -2)
            for proj in ("k_proj", "v_proj"):
                narrow(weights, f"{path}.{proj}", kv_start * d, kv_stop * d, attn.kv_heads * d, -2)
            narrow(weights, f"{path}.o_proj", kv_start * group * d, kv_stop * group * d, attn.heads * d, -1)
            attn.heads, attn.kv_heads = (kv_stop - kv_start) * group, kv_stop - kv_start
        elif isinstance(attn, LatentAttention):
            self.check_enough(attn.heads, "attention heads")
            start, stop = shares(attn.heads, self.size)[self.rank]
            per_head = attn.nope_dims + attn.rope_dims
            query = "q_proj" if "q_proj" in attn else "q_b_proj"
            narrow(weights, f"{path}.{query}", start * per_head, stop * per_head, attn.heads * per_head, -2)
            for proj in ("key_up_proj", "value_up_proj"):
                narrow(weights, f"{path}.{proj}", start, stop, attn.heads, 0)
            v = attn.value_dims
            narrow(weights, f"{path}.o_proj", start * v, stop * v, attn.heads * v, -1)
            attn.heads = stop - start
        else:
            raise InvalidSettingError(f"--tensor-parallel cannot divide a {type(attn).__name__}; use --pipeline")
        self.drop_bias(attn.o_proj, f"{path}.o_proj", weights)

    def take_ffn(self, ffn: nn.Module, path: str, weights: dict[str, mx.array]) -> tuple[int, int] | None:
        """Tensor parallel: this rank's hidden columns of an FFN, or its experts (and shared columns) of an MoE;
        returns the expert range of an MoE."""
        if isinstance(ffn, MoE):
            self.check_enough(ffn.num_experts, "experts")
            start, stop = shares(ffn.num_experts, self.size)[self.rank]
            for proj in ("gate_proj", "up_proj", "down_proj"):
                narrow(weights, f"{path}.experts.{proj}", start, stop, ffn.num_experts, 0)
            if "shared_experts" in ffn:
                self.take_ffn(ffn.shared_experts, f"{path}.shared_experts", weights)
            return start, stop
        if not isinstance(ffn, (MLP, SwiGLU)):
            raise InvalidSettingError(f"--tensor-parallel cannot divide a {type(ffn).__name__}; use --pipeline")
        hidden = ffn.up_proj.weight.shape[0]
        start, stop = shares(hidden, self.size, getattr(ffn.down_proj, "group_size", 1))[self.rank]
        for proj in ("gate_proj", "up_proj"):
            if proj in ffn:
                narrow(weights, f"{path}.{proj}", start, stop, hidden, -2)
        narrow(weights, f"{path}.down_proj", start, stop, hidden, -1)
        self.drop_bias(ffn.down_proj, f"{path}.down_proj", weights)
        return None

    def check_enough(self, count: int, what: str) -> None:
        if count < self.size:
            raise InvalidSettingError(f"{count} {what} cannot be divided among {self.size} ranks; use --pipeline")

    def drop_bias(self, linear: nn.Module, path: str, weights: dict[str, mx.array]) -> None:
        """A projection whose output is summed across ranks adds its bias on rank 0 only."""
        if self.rank != 0 and "bias" in linear:
            linear.pop("bias")
            weights.pop(f"{path}.bias", None)


def constraint_fields(constraint: Constraint | None) -> list[str] | None:
    return [constraint.kind, constraint.source] if constraint is not None else None


class Mirrored(Engine):
    """`serve`'s engine on every rank: all ranks take the same steps with the same sequences in them.

    Requests reach rank 0 only. At the start of each of its steps, rank 0 tells the others (one all_sum of the
    message's length, and of the message when there is one) which requests joined and which sequences were
    cancelled since its last step; the other ranks (`follow`) replay that, then step too. A step holds the
    engine's lock, so that nothing joins or leaves between what rank 0 announces and what it runs. The other
    ranks sample greedily: their tokens are replaced by rank 0's (`Distributed.agree`) anyway.
    """

    def __init__(self, model: Distributed, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        self.lock = threading.RLock()
        self.group, self.rank = model.group, model.rank
        self.joined: list[Generation] = []
        self.cancelled: list[int] = []
        self.sequences: list[Generation] = []  # every sequence submitted, by number

    def submit(self, request: Request) -> Generation:
        with self.lock:
            sequence = super().submit(request)
            self.joined.append(sequence)
            return sequence

    def cancel(self, sequence: Generation) -> None:
        with self.lock:
            super().cancel(sequence)
            self.cancelled.append(sequence)

    def step(self) -> list[Output]:
        with self.lock, self.step_guard():  # the announcement waits on the other ranks too
            joined, self.joined = self.joined, []
            cancelled, self.cancelled = self.cancelled, []
            news = [
                [
                    s.request.prompt,
                    s.request.settings.max_tokens,
                    s.seed,
                    list(s.request.settings.stop),
                    sorted(s.stop_ids),
                    constraint_fields(s.request.settings.constraint),
                ]
                for s in joined
            ]
            self.sequences += joined
            numbers = {id(s): n for n, s in enumerate(self.sequences)}
            self.announce(json.dumps([news, [numbers[id(s)] for s in cancelled]]) if news or cancelled else "")
            return super().step()

    def announce(self, message: str) -> str:
        """Rank 0's `message` on every rank ("" when it has nothing to say)."""
        data = np.frombuffer(message.encode(), dtype=np.uint8)
        size = mx.distributed.all_sum(mx.array(data.size if self.rank == 0 else 0), group=self.group).item()
        if size == 0:
            return ""
        mine = mx.array(data) if self.rank == 0 else mx.zeros((size,), mx.uint8)
        return bytes(np.array(mx.distributed.all_sum(mine, group=self.group))).decode()

    def follow(self) -> None:
        """The other ranks' side: replay rank 0's steps until it stops (then the next all_sum fails)."""
        while True:
            message = self.announce("")
            if message:
                news, cancelled = json.loads(message)
                for prompt, max_tokens, seed, stop, stop_ids, constraint in news:
                    # a grammar ends a sequence where its answer is complete: every rank must know it
                    constraint = Constraint(*constraint) if constraint else None
                    settings = SamplingSettings(max_tokens, seed=seed, stop=stop, constraint=constraint)
                    request = Request(prompt, settings, stop_ids=frozenset(stop_ids))
                    self.sequences.append(Engine.submit(self, request))
                for number in cancelled:
                    Engine.cancel(self, self.sequences[number])
            Engine.step(self)
