"""llama-quantize's Q4_K_M, Q5_K_S and Q6_K, in Python over ggml's own quantizers (`llamacpp.ggml_quantize`).

`quantize(Reader(source), target, ftype)` writes what `llama-quantize --allow-requantize source target ftype`
writes from a GGUF of llama.cpp's converter without an importance matrix, byte for byte: the metadata copied, with
`general.quantization_version` and `general.file_type` set (hence last, as llama.cpp's gguf_set_* append them); the
tensors in llama.cpp's order, each in the type src/llama-quant.cpp's `llama_tensor_get_type` gives it, quantized by
the same C code (the reference row quantizers, which `ggml_quantize_chunk` runs when there is no importance matrix;
llama-quantize's threads only share out the rows). Tensors already quantized (gpt-oss's MXFP4 experts) are
dequantized and quantized again, as `--allow-requantize` does (without it llama-quantize refuses such a file).

Only the rules of `llama_tensor_get_type` that can apply to these three file types are here; those for other types
(Q2_K..Q3_K, IQ*, MXFP4_MOE), for Falcon, GLM-5 and 70B Llamas, and for tensors none of the converted families has
(Mamba's conv1d, Gemma 3n's altup, ...) are left out.
"""

import re
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGML_QUANT_VERSION, GGUFReader, GGUFWriter, LlamaFileType
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from llamacpp import ggml_quantize

# file type -> (its general.file_type, the type its tensors get unless a rule below says otherwise)
FTYPES = {
    "Q4_K_M": (LlamaFileType.MOSTLY_Q4_K_M, T.Q4_K),
    "Q5_K_S": (LlamaFileType.MOSTLY_Q5_K_S, T.Q5_K),
    "Q6_K": (LlamaFileType.MOSTLY_Q6_K, T.Q6_K),
}
FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}  # for rows that are not whole blocks of 256
# never quantized (Gemma 4's per_layer_model_proj: "not too big", llama-quant.cpp says)
KEPT = ("_norm.weight", "ffn_gate_inp.weight", "position_embd.weight", "token_types.weight", "per_layer_model_proj")
TOKEN_EMBD = ("token_embd.weight", "per_layer_token_embd.weight")
ATTN_V = ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")  # the tensors llama.cpp finds most sensitive
MOVED = ("general.quantization_version", "general.file_type")  # set by llama-quantize, hence last


def quantize(reader: GGUFReader, target: Path, ftype: str) -> None:
    """A GGUF file (F32, or any types), as read by gguf's reader (reading a 49k-token vocabulary takes it a second:
    read once, quantize to each type) -> `target` as llama-quantize writes it for `ftype` (a key of FTYPES)."""
    fields = {name: field for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    architecture = fields["general.architecture"].contents()
    choose = TypeChoice(ftype, [t.name for t in reader.tensors], architecture, fields)
    writer = GGUFWriter(target, architecture)
    for name, field in fields.items():
        if name not in ("general.architecture", *MOVED):
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=field.types[-1])
    writer.add_quantization_version(GGML_QUANT_VERSION)
    writer.add_file_type(FTYPES[ftype][0])
    for tensor in sorted(reader.tensors, key=lambda t: (layer_of(t.name), t.name)):  # llama.cpp's weights_map order
        shape = dims(tensor)
        kind = choose(tensor.name, shape, tensor.tensor_type)
        data = converted(tensor, kind)
        writer.add_tensor(tensor.name, data.reshape(data.shape[data.ndim - len(shape) :]), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def dims(tensor) -> list[int]:
    """A tensor's shape (GGUF's order, row length first) as ggml counts its dimensions: without trailing 1s, which
    llama-quantize drops (a (64, 1) router of a shared expert is a vector of 64 there, hence not quantized)."""
    shape = [int(n) for n in tensor.shape]
    while len(shape) > 1 and shape[-1] == 1:
        shape.pop()
    return shape


def converted(tensor, kind: T) -> np.ndarray:
    """A tensor's data in type `kind`: its own bytes when it has that type already."""
    if kind == tensor.tensor_type:
        return tensor.data
    floats = tensor.data if tensor.tensor_type == T.F32 else dequantize(tensor.data, tensor.tensor_type)
    return floats.astype(np.float16) if kind == T.F16 else ggml_quantize(kind, floats)


def layer_of(name: str) -> int:
    """The block a tensor belongs to (`blk.N.`), -1 for the others."""
    return int(match[1]) if (match := re.match(r"blk\.(\d+)\.", name)) else -1


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers whose sensitive tensors get more bits: the first and last eighths, and every
    third layer in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


class TypeChoice:
    """`llama_tensor_get_type` for one file, called on its tensors in llama.cpp's order (its counters of attn_v and
    ffn_down tensors depend on it): a tensor's name, shape (GGUF's order, row length first) and type -> its type."""

    def __init__(self, ftype: str, names: list[str], architecture: str, fields: dict):
        self.ftype, self.default = ftype, FTYPES[ftype][1]
        self.tied = "output.weight" not in names  # the token embedding is then the output matrix too
        self.n_layers = int(fields[f"{architecture}.block_count"].contents())
        experts = fields.get(f"{architecture}.expert_count")
        self.n_experts = int(experts.contents()) if experts else 0
        self.n_attention_v, self.i_attention_v = sum(name.endswith(ATTN_V) for name in names), 0
        self.i_ffn_down = 0

    def __call__(self, name: str, shape: list[int], kind: T) -> T:
        if len(shape) < 2 or not name.endswith("weight") or any(part in name for part in KEPT):
            return kind
        more_bits = self.ftype == "Q4_K_M"
        new = self.default
        if name == "output.weight" or (self.tied and name in TOKEN_EMBD):
            new = T.Q8_0 if shape[0] % GGML_QUANT_SIZES[new][0] else T.Q6_K
        elif name.endswith(ATTN_V):
            if more_bits and use_more_bits(self.i_attention_v, self.n_attention_v):
                new = T.Q6_K
            if self.n_experts == 8:  # "for the 8-expert model, bumping this to Q8_0 trades just ~128MB"
                new = T.Q8_0
            self.i_attention_v += 1
        elif name.endswith("attn_k.weight") and self.n_experts == 8:
            new = T.Q8_0
        elif "ffn_down" in name:
            i_layer = layer_of(name) if self.n_experts > 1 else self.i_ffn_down  # experts: per-expert tensors
            if more_bits and use_more_bits(i_layer, self.n_layers):
                new = T.Q6_K
            self.i_ffn_down += 1
        elif name.endswith("attn_output.weight") and self.n_experts == 8 and more_bits:
            new = T.Q5_K
        return fitting(new, shape[0])


def fitting(kind: T, row: int) -> T:
    """`kind`, or for rows that are not whole blocks of it the type llama.cpp falls back to (F16 as the last)."""
    if row % GGML_QUANT_SIZES[kind][0] == 0:
        return kind
    kind = FALLBACK.get(kind, kind)
    return kind if row % GGML_QUANT_SIZES[kind][0] == 0 else T.F16
