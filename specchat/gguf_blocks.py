"""GGML's quantized block formats dequantized in torch, bit for bit as gguf-py's numpy does it.

Why our own: gguf-py's `dequantize`, which transformers' GGUF loading calls for every tensor, builds each
intermediate over a whole tensor in numpy on one core: 6.7-7.3 s of the 0.5B's conversion at its first
start (2-vCPU Xeon, AVX-512), where the kernel's compile wants the other core. Here a tensor is dequantized
`WEIGHTS_PER_CHUNK` weights at a time on torch's threads, its intermediates in cache: 2.0-2.1 s for the
same tensors. Each format runs gguf-py's operations in gguf-py's order (a weight is one float32 product of
the same two operands, or that product less another), so the floats are the same ones (the converted
0.5B's file is byte for byte as before); formats not here go to gguf-py.

Block layouts are ggml's (ggml-common.h): `d` and `dmin` are float16 scales, `qs` low bits, `qh` high bits.
"""

from __future__ import annotations

import warnings

import numpy
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as numpy_dequantize  # (the module's own: converting patches `gguf.dequantize`)
from gguf.quants import quant_shape_from_byte_shape

# A 512 KB float32 chunk: its intermediates stay in L2, and below glibc's threshold for mapping (and
# faulting in) fresh pages for each (a 0.5B's Q5_0 embedding: 0.5 s in chunks of 128k weights, 1.1 s of 512k)
WEIGHTS_PER_CHUNK = 131072
_BIT_OF_BYTE = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).to(torch.uint8)  # [byte][bit], low first


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at bytes [start, start + 2) of each block, as a float32 column."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _shifted(values: torch.Tensor, shifts: list[int]) -> torch.Tensor:
    """values[..., None, :] >> each shift: gguf-py's broadcast unpacking of bit fields."""
    *lead, width = values.shape
    by = torch.tensor(shifts, dtype=torch.uint8).reshape(len(shifts), 1)
    return values.reshape(*lead, 1, width) >> by


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:  # d, qs[16]: w = d * (nibble - 8)
    n = blocks.shape[0]
    q = (_shifted(blocks[:, 2:], [0, 4]) & 0x0F).reshape(n, 32).to(torch.int8) - 8
    return _halves(blocks, 0) * q.float()


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:  # d, qh[4], qs[16]: w = d * ((nibble | bit << 4) - 16)
    n = blocks.shape[0]
    high = _BIT_OF_BYTE[blocks[:, 2:6].long()].reshape(n, 32)  # qh's 32 bits, low first
    low = (_shifted(blocks[:, 6:], [0, 4]) & 0x0F).reshape(n, 32)
    return _halves(blocks, 0) * ((low | (high << 4)).to(torch.int8) - 16).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:  # d, qs[32] int8: w = d * q
    return _halves(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _k_steps(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's d * scale and dmin * min for each of a block's eight sub-blocks [n, 8, 1]: d, dmin,
    then twelve bytes of eight 6-bit scales and eight 6-bit mins (gguf-py's get_scale_min)."""
    n = blocks.shape[0]
    d, m, m_d = blocks[:, 4:16].reshape(n, 3, 4).unbind(1)
    scales = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return ((_halves(blocks, 0) * scales.float()).reshape(n, 8, 1),
            (_halves(blocks, 2) * mins.float()).reshape(n, 8, 1))


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:  # d, dmin, scales[12], qs[128]: w = d*scale * q - dmin*min
    n = blocks.shape[0]
    d, dm = _k_steps(blocks)
    q = (_shifted(blocks[:, 16:].reshape(n, 4, 32), [0, 4]) & 0x0F).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, 256)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:  # d, dmin, scales[12], qh[32], qs[128]
    n = blocks.shape[0]
    d, dm = _k_steps(blocks)
    low = (_shifted(blocks[:, 48:].reshape(n, 4, 32), [0, 4]) & 0x0F).reshape(n, 8, 32)
    high = (_shifted(blocks[:, 16:48].reshape(n, 1, 32), list(range(8))) & 0x01).reshape(n, 8, 32)
    return (d * (low | (high << 4)).float() - dm).reshape(n, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:  # ql[128], qh[64], scales[16] int8, d: w = d*scale * (q - 32)
    n = blocks.shape[0]
    d = (_halves(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    low = (_shifted(blocks[:, :128].reshape(n, 2, 64), [0, 4]) & 0x0F).reshape(n, 8, 32)
    high = (_shifted(blocks[:, 128:192].reshape(n, 2, 32), [0, 2, 4, 6]) & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, 256)


FORMATS = {
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}


def dequantize(data: numpy.ndarray, qtype: GGMLQuantizationType,
               dtype: torch.dtype | None = None) -> numpy.ndarray | torch.Tensor:
    """`gguf.dequantize(data, qtype)`: a tensor's blocks (uint8 rows, as GGUFReader gives them) as a new
    float32 array of the weights' shape, which nothing else holds. With `dtype`, a format here gives a
    tensor in `dtype` instead: each chunk's float32 weights rounded to it as `Tensor.to` rounds them,
    without the whole tensor in float32 first (fresh pages each: 2 GB of the 0.5B's, 6 of the 1.5B's)."""
    weights_of = FORMATS.get(qtype)
    if weights_of is None:
        return numpy_dequantize(data, qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    shape = quant_shape_from_byte_shape(data.shape, qtype)
    with warnings.catch_warnings():  # the file's map is read-only; it is only read here
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        blocks = torch.from_numpy(numpy.ascontiguousarray(data).view(numpy.uint8).reshape(-1, type_size))
    weights = torch.empty(blocks.shape[0], block_size, dtype=dtype or torch.float32)
    chunk = max(1, WEIGHTS_PER_CHUNK // block_size)
    for start in range(0, blocks.shape[0], chunk):
        weights[start:start + chunk] = weights_of(blocks[start:start + chunk])
    return weights.reshape(shape) if dtype is not None else weights.numpy().reshape(shape)
