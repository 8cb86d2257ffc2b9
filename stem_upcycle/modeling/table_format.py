"""How a STEM table's rows are stored: floats, or compressed to int8, fp8 or int4 with per-block scales.

A compressed table of layer L is two plain safetensors tensors next to each other:

    model.layers.L.mlp.up_table.qweight  [vocab, d_ff]     int8 | float8_e4m3fn
                                         [vocab, d_ff / 2] uint8 (int4: two values a byte, the even
                                                           element in the low nibble)
    model.layers.L.mlp.up_table.scales   [vocab, d_ff / block] float16

(d_ff: a row's elements, the table's columns: k where a layer's table holds some of its neurons,
`config.stem_table_columns`) and `config.stem_table_format` = {"dtype": ..., "block_size": ...}. Row r is
qweight[r] * scales[r] repeated over each block of `block_size` elements: symmetric, no offsets, so
every format decodes the same way. A row is decoded alone, from its own bytes, which is what lets
every placement read and dequantise only the rows a forward uses.

Block sizes, measured on SmolLM2-135M's recovered tables (relative L2 error of a row; bf16 0.16%):
int8 0.8-1.1% at 128 (0.6-0.8% at 32), fp8 2.4% at 128 (2.2% at 32), int4 11-16% at 64 (clipped,
below). With float16 scales, 128-element blocks are the smallest that keep int8 and fp8 within
0.51x of bf16's bytes (1 + 2/128 bytes per element), and 64 the smallest for int4 within 0.28x.

Exported next to the weights, so it imports only torch.
"""

from dataclasses import dataclass

import torch

from .configuration_stem import table_columns

FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Compressed dtypes: the largest magnitude of a stored value, and the default block size.
COMPRESSED = {"int8": (127.0, 128), "float8": (448.0, 128), "int4": (7.0, 64)}
TABLE_DTYPES = (*FLOAT_DTYPES, *COMPRESSED)
SCALE_DTYPE = torch.float16
# int4 clips each block to the fraction of its largest magnitude (of these) that reconstructs it best:
# a few outliers would otherwise leave most values one or two of the 16 levels (error 12-18% -> 11-16%).
INT4_CLIP = tuple(0.5 + 0.05 * i for i in range(11))


class TableFormatError(ValueError):
    """A table format that cannot be used; the message names the problem and the fix."""


@dataclass(frozen=True)
class TableFormat:
    """How rows are stored: `dtype` one of TABLE_DTYPES; `block_size` elements share one scale (compressed)."""

    dtype: str
    block_size: int = 0

    @classmethod
    def of(cls, dtype: str, block_size: int | None = None, d_ff: int | None = None) -> "TableFormat":
        """The format of `dtype` (a compressed one with `block_size`, else its default), checked against `d_ff`."""
        if dtype not in TABLE_DTYPES:
            raise TableFormatError(f"table dtype {dtype!r} is unknown; choose one of {', '.join(TABLE_DTYPES)}")
        if dtype in FLOAT_DTYPES:
            return cls(dtype)
        block = int(block_size or COMPRESSED[dtype][1])
        if block < 2 or block % 2:
            raise TableFormatError(f"block size {block} must be an even number of elements, at least 2")
        if d_ff is not None and d_ff % block:
            raise TableFormatError(f"rows of {d_ff} elements do not split into blocks of {block}; give a block size "
                                   f"that divides {d_ff}")
        return cls(dtype, block)

    @classmethod
    def from_config(cls, config) -> "TableFormat | None":
        """The compressed format `config.stem_table_format` names; None for float tables (as their files say)."""
        spec = getattr(config, "stem_table_format", None)
        if not spec:
            return None
        for width in {table_columns(config, layer) for layer in config.stem_layers}:  # each table's rows, checked
            cls.of(spec["dtype"], spec.get("block_size"), width)
        return cls.of(spec["dtype"], spec.get("block_size"))

    def to_config(self) -> dict | None:
        return {"dtype": self.dtype, "block_size": self.block_size} if self.compressed else None

    def describe(self) -> str:
        if not self.compressed:
            return self.dtype
        return f"{self.dtype} with a float16 scale per {self.block_size} elements"

    @property
    def compressed(self) -> bool:
        return self.dtype in COMPRESSED

    def parts(self, d_ff: int) -> dict[str, tuple[int, torch.dtype]]:
        """Tensor suffix -> (elements per row, dtype) of what a table of rows of `d_ff` is stored as."""
        if not self.compressed:
            return {"weight": (d_ff, FLOAT_DTYPES[self.dtype])}
        values = {"int8": (d_ff, torch.int8), "float8": (d_ff, torch.float8_e4m3fn), "int4": (d_ff // 2, torch.uint8)}
        return {"qweight": values[self.dtype], "scales": (d_ff // self.block_size, SCALE_DTYPE)}

    def row_bytes(self, d_ff: int) -> int:
        return sum(n * dtype.itemsize for n, dtype in self.parts(d_ff).values())

    def encode(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The stored parts of `rows` [n, d_ff] (any float dtype; computed in fp32)."""
        if not self.compressed:
            return {"weight": rows.to(FLOAT_DTYPES[self.dtype])}
        n, d_ff = rows.shape
        blocks = rows.float().reshape(n, d_ff // self.block_size, self.block_size)  # [n, blocks, block]
        largest = COMPRESSED[self.dtype][0]
        if self.dtype == "int4":
            values, scales = _clipped_int4(blocks)
        else:
            scales = _scales(blocks.abs().amax(-1), largest)  # [n, blocks]
            scaled = (blocks / _nonzero(scales)[..., None]).clamp(-largest, largest)
            values = scaled.round().to(torch.int8) if self.dtype == "int8" else scaled.to(torch.float8_e4m3fn)
        values = values.reshape(n, d_ff)
        if self.dtype == "int4":  # two's complement nibbles, the even element low
            nibbles = (values.to(torch.int16) & 0xF).to(torch.uint8)
            values = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
        return {"qweight": values, "scales": scales.to(SCALE_DTYPE)}

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Rows [n, d_ff] in `dtype` from their stored parts (on any device)."""
        if not self.compressed:
            return parts["weight"].to(dtype)
        values, scales = parts["qweight"], parts["scales"]
        n = values.shape[0]
        if self.dtype == "int4":  # arithmetic shifts of the signed byte sign-extend each nibble
            signed = values.view(torch.int8)
            values = torch.stack([(signed << 4) >> 4, signed >> 4], -1).float()  # [n, d_ff / 2, 2]
        elif self.dtype == "float8":  # a byte's value from a 256-entry table: 3x faster than the cast on a CPU
            values = _float8_values(values.device).index_select(0, values.view(torch.uint8).flatten().int())
        else:
            values = values.float()
        blocks = values.reshape(n, -1, self.block_size) * scales.float()[..., None]
        return blocks.reshape(n, -1).to(dtype)


_FLOAT8_VALUES = {}  # device -> [256] the float32 value of each float8 e4m3 byte


def _float8_values(device: torch.device) -> torch.Tensor:
    if device not in _FLOAT8_VALUES:
        byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        _FLOAT8_VALUES[device] = byte.view(torch.float8_e4m3fn).float().to(device)
    return _FLOAT8_VALUES[device]


def _scales(amax: torch.Tensor, largest: float) -> torch.Tensor:
    """Per-block scales as stored (float16), so that encoding divides by exactly what decoding multiplies."""
    scales = (amax / largest).to(SCALE_DTYPE)
    if not bool(torch.isfinite(scales).all()):
        raise TableFormatError("a table holds values beyond float16 scales (|x| > 1e6) or NaN; check the model's "
                               "tables before compressing them")
    return scales.float()


def _nonzero(scales: torch.Tensor) -> torch.Tensor:
    return torch.where(scales == 0, torch.ones_like(scales), scales)  # an all-zero block stays zero


def _clipped_int4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values in -8..7, float16-exact scales) per block, each block clipped where its error is least."""
    amax = blocks.abs().amax(-1)  # [n, blocks]
    best_scales, best_error = None, None
    for clip in INT4_CLIP:  # only the scales and errors are kept per candidate: the values are made once, at the end
        scales = _scales(amax * clip, 7.0)
        error = ((blocks / _nonzero(scales)[..., None]).round_().clamp_(-8, 7).mul_(scales[..., None]).sub_(blocks)
                 .square_().sum(-1))  # [n, blocks]
        if best_error is None:
            best_scales, best_error = scales, error
        else:
            better = error < best_error
            best_scales = torch.where(better, scales, best_scales)
            best_error = torch.minimum(error, best_error)
    values = (blocks / _nonzero(best_scales)[..., None]).round_().clamp_(-8, 7)
    return values.to(torch.int8), best_scales
