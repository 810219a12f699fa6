"""Tensor parallelism (`--tensor-parallel`): each rank holds some of every attention's KV heads (with their query
heads; latent attention by heads), some of every FFN's hidden columns, some of every MoE's experts.

Each sub-layer then returns a partial sum, completed by one `all_sum` per sub-layer. Embedding, norms, routers
and head are replicated; rank 0 samples.
"""

import mlx.core as mx
import mlx.nn as nn

from ..core.attention import Attention
from ..core.ffn import MLP, SwiGLU
from ..core.latent_attention import LatentAttention
from ..core.moe import MoE
from ..errors import InvalidSettingError
from .split import Split


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


def quantization_group(linear: nn.Module) -> int:
    """How many input columns `linear` packs together: a cut between its columns must fall between groups."""
    return linear.group_size if isinstance(linear, nn.QuantizedLinear) else 1


class TensorSplit(Split):
    """This rank's share of every layer, whose sub-layers end in an all_sum."""

    mode = "tensor"
    flag = "--tensor-parallel"

    def __init__(self, group: mx.distributed.Group, room: int):
        super().__init__(group, room)
        self.experts: list[tuple[int, int] | None] = []  # each layer's expert range, if MoE

    def sampling_rank(self) -> int:
        return 0

    def passes_on(self) -> bool:
        return False

    def cut(self, model: nn.Module, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        for i, layer in enumerate(model.layers):
            self.take_attention(layer.attn, f"layers.{i}.attn", weights)
            self.experts.append(self.take_ffn(layer.ffn, f"layers.{i}.ffn", weights))
        self.tensors = sorted(weights)
        return weights

    def link(self, model: nn.Module) -> None:
        for layer, experts in zip(model.layers, self.experts):
            if experts is not None:
                layer.ffn.experts = ExpertRange(layer.ffn.experts, experts[0], experts[1] - experts[0])
            layer.attn, layer.ffn = Summed(layer.attn, self.group), Summed(layer.ffn, self.group)

    def take_attention(self, attn: nn.Module, path: str, weights: dict[str, mx.array]) -> None:
        """This rank's heads of an attention (KV heads with their query heads; latent attention by heads)."""
        if isinstance(attn, Attention):
            self.take_kv_heads(attn, path, weights)
        elif isinstance(attn, LatentAttention):
            self.take_latent_heads(attn, path, weights)
        else:
            raise InvalidSettingError(f"--tensor-parallel cannot divide a {type(attn).__name__}; use --pipeline")
        self.drop_bias(attn.o_proj, f"{path}.o_proj", weights)

    def take_kv_heads(self, attn: Attention, path: str, weights: dict[str, mx.array]) -> None:
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

    def take_latent_heads(self, attn: LatentAttention, path: str, weights: dict[str, mx.array]) -> None:
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

    def take_ffn(self, ffn: nn.Module, path: str, weights: dict[str, mx.array]) -> tuple[int, int] | None:
        """This rank's hidden columns of an FFN, or its experts (and shared columns) of an MoE; returns the expert
        range of an MoE."""
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
        start, stop = shares(hidden, self.size, quantization_group(ffn.down_proj))[self.rank]
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
