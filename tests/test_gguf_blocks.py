"""specchat.gguf_blocks: GGML's block formats dequantized in torch give gguf-py's floats, bit for bit."""

import warnings

import numpy
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as numpy_dequantize

from specchat import gguf_blocks

# where each format keeps its float16 scales (random bytes there could be NaNs, whose bits need not agree)
FLOAT16_BYTES = {"Q4_0": [0], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(qtype: GGMLQuantizationType, rows: int, blocks_per_row: int, seed: int) -> numpy.ndarray:
    """A tensor's bytes as GGUFReader gives them (uint8 rows): random codes, finite random scales."""
    generator = numpy.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = generator.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=numpy.uint8)
    for start in FLOAT16_BYTES[qtype.name]:
        scales = generator.normal(0, 0.05, size=rows * blocks_per_row).astype(numpy.float16)
        blocks[:, start:start + 2] = scales.view(numpy.uint8).reshape(-1, 2)
    return blocks.reshape(rows, blocks_per_row * type_size)


def test_every_format_covered_here_has_a_scale_layout_in_this_test():
    assert {qtype.name for qtype in gguf_blocks.FORMATS} == set(FLOAT16_BYTES)


@pytest.mark.parametrize("qtype", list(gguf_blocks.FORMATS), ids=lambda qtype: qtype.name)
def test_each_format_dequantizes_to_gguf_pys_floats_bit_for_bit(qtype, monkeypatch):
    # chunks smaller than the tensor, the last one partial: a chunk's rows must land in their place
    monkeypatch.setattr(gguf_blocks, "WEIGHTS_PER_CHUNK", 5 * 32)  # 5 blocks, or 1 of 256
    data = random_blocks(qtype, rows=3, blocks_per_row=4, seed=qtype.value)
    expected, got = numpy_dequantize(data, qtype), gguf_blocks.dequantize(data, qtype)
    assert got.dtype == numpy.float32 and got.shape == expected.shape
    assert numpy.array_equal(got.view(numpy.uint32), expected.view(numpy.uint32))
    assert got.flags.writeable  # a fresh array, which transformers wraps uncopied


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("qtype", list(gguf_blocks.FORMATS), ids=lambda qtype: qtype.name)
def test_each_format_dequantizes_into_a_dtype_as_its_floats_round_to_it(qtype, dtype, monkeypatch):
    """Into a dtype chunk by chunk (a conversion's weights), the values `Tensor.to` gives the float32 ones."""
    monkeypatch.setattr(gguf_blocks, "WEIGHTS_PER_CHUNK", 5 * 32)
    data = random_blocks(qtype, rows=3, blocks_per_row=4, seed=qtype.value)
    expected = torch.from_numpy(numpy_dequantize(data, qtype)).to(dtype)
    got = gguf_blocks.dequantize(data, qtype, dtype)
    assert got.dtype == dtype and got.shape == expected.shape and torch.equal(got.view(torch.int16),
                                                                            expected.view(torch.int16))


def test_a_read_only_map_is_read_without_a_warning():
    data = random_blocks(GGMLQuantizationType.Q8_0, rows=2, blocks_per_row=3, seed=0)
    data.flags.writeable = False  # as a GGUF file's map is
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gguf_blocks.dequantize(data, GGMLQuantizationType.Q8_0)


def test_formats_not_covered_here_go_to_gguf_py(monkeypatch):
    calls = []
    monkeypatch.setattr(gguf_blocks, "numpy_dequantize", lambda data, qtype: calls.append(qtype) or "gguf-py's")
    assert GGMLQuantizationType.Q4_1 not in gguf_blocks.FORMATS
    assert gguf_blocks.dequantize(numpy.zeros((1, 20), numpy.uint8), GGMLQuantizationType.Q4_1) == "gguf-py's"
    assert calls == [GGMLQuantizationType.Q4_1]
