"""Quantization and conversion ops of the FORMATS.md contract.

Every function here routes CUDA tensors to the CUDA kernels (``ds_fp4.ops.cuda``) and
everything else to the pure-PyTorch reference (``ds_fp4.ops.reference``); both have the
same signatures and agree bit for bit. Which one CUDA tensors get is set by
``set_kernels`` / the ``DS_FP4_KERNELS`` environment variable (see ``ds_fp4.ops.backend``);
the same setting governs the FP8 experts' tile and segment quantizers and the grouped GEMMs.
Every op takes ``out=``: None (new outputs), or tensors of the outputs' shapes and dtypes
(one per output) that are written and returned, e.g. to time a kernel without allocation.
"""

from ds_fp4.ops.backend import get_kernels, kernels, set_kernels, select
from ds_fp4.ops.rows import split_fp8_rows, split_mxfp4_rows
# these route themselves (kernels on CUDA where set_kernels allows, twins elsewhere)
from ds_fp4.ops.grouped_gemm import k_grouped_gemm_fp8_nt, m_grouped_gemm_fp8_nt
from ds_fp4.ops.fp8_segments import segment_quant
from ds_fp4.ops.fp8_tiles import dequantize_fp8_tiles, quantize_fp8_tiles, tile_quant
from ds_fp4.ops.route_grads import route_gate_grads, route_grads
from ds_fp4.ops.encode_routes import encode_routes, route_map
from ds_fp4.ops.split_bf16 import split_bf16
from ds_fp4.ops.route_sums import slot_sum, weighted_route_sum, weighted_route_sum_kept

__all__ = [
    "quantize_mxfp4", "dequantize_mxfp4", "quantize_fp8", "dequantize_fp8",
    "mxfp4_to_fp8", "mxfp4_to_fp8_colwise", "m_grouped_gemm_fp8_nt", "k_grouped_gemm_fp8_nt",
    "quantize_mxfp4_rows", "dequantize_mxfp4_rows", "mxfp4_rows_to_fp8",
    "quantize_fp8_rows", "dequantize_fp8_rows",
    "split_mxfp4_rows", "split_fp8_rows",
    "quantize_fp8_tiles", "dequantize_fp8_tiles", "tile_quant", "segment_quant", "route_grads",
    "route_gate_grads",
    "encode_routes", "route_map", "split_bf16", "weighted_route_sum", "weighted_route_sum_kept",
    "slot_sum",
    "get_kernels", "set_kernels", "kernels",
]


def quantize_mxfp4(x, rounding="rceil", out=None):
    """bf16/fp16/fp32 ``[..., K]`` -> MXFP4 ``(data uint8 [..., K/2], scales uint8 [..., K/32])``."""
    return select(x).quantize_mxfp4(x, rounding, out=out)


def dequantize_mxfp4(data, scales, dtype=None, out=None):
    """MXFP4 ``(data [..., K/2], scales [..., K/32])`` -> ``dtype`` (default bf16) ``[..., K]``."""
    return select(data, scales).dequantize_mxfp4(data, scales, dtype, out=out)


def quantize_fp8(x, out=None):
    """``[M, K]`` -> FP8 1x128 ``(data e4m3 [M, K], scales fp32 [M, K/128] strides (1, M))``."""
    return select(x).quantize_fp8(x, out=out)


def dequantize_fp8(data, scales, dtype=None, out=None):
    """FP8 1x128 ``(data [M, K], scales [M, K/128])`` -> ``dtype`` (default bf16) ``[M, K]``."""
    return select(data, scales).dequantize_fp8(data, scales, dtype, out=out)


def mxfp4_to_fp8(data, scales, counts=None, out=None):
    """MXFP4 ``[M, K]`` -> FP8 1x128, bit for bit ``quantize_fp8(dequantize_mxfp4(...))``.

    ``counts``: None, or an int64 ``[3]`` tensor on data's device to which the conversion
    adds (inexact groups, NaN groups, all groups) as a by-product; which groups count is
    spelt out in ``ds_fp4.ops.reference.mxfp4_to_fp8``. The same for the two ops below.
    """
    return select(data, scales).mxfp4_to_fp8(data, scales, counts, out=out)


def mxfp4_to_fp8_colwise(data, scales, offsets, counts=None, out=None):
    """MXFP4 rows ``[T, K]`` in segments ``offsets`` -> FP8 columns ``[K, sum P_g]``.

    ``offsets`` may live on the host (a list of ints or a CPU tensor): that spares CUDA
    callers a device sync, since the output width is read from them. ``counts``: as for
    ``mxfp4_to_fp8``, per column group of 128 tokens.
    """
    return select(data, scales).mxfp4_to_fp8_colwise(data, scales, offsets, counts, out=out)


def quantize_mxfp4_rows(x, rounding="rceil", out=None, index=None):
    """``[..., K]`` -> packed MXFP4 rows uint8 ``[..., K/2 + K/32]`` (wire/cache layout).
    ``index``: None, or int64 ``[R]`` (x ``[M, K]``): the rows ``x[index]`` (a zero row where
    an index is outside ``[0, M)``) quantized in one pass, without the gathered copy."""
    return select(x).quantize_mxfp4_rows(x, rounding, out=out, index=index)


def dequantize_mxfp4_rows(rows, dtype=None, k=None, out=None):
    """Packed MXFP4 rows uint8 ``[..., K/2 + K/32]`` -> ``dtype`` (default bf16) ``[..., K]``.

    ``k`` (K, e.g. the hidden size): required where the row width also fits FP8 rows
    (multiples of 2193 bytes), so that FP8 rows passed here raise instead of decoding into
    the wrong shape; checked against the width where given. The same for every row op.
    """
    return select(rows).dequantize_mxfp4_rows(rows, dtype, k, out=out)


def mxfp4_rows_to_fp8(rows, k=None, counts=None, out=None):
    """Packed MXFP4 rows ``[M, K/2 + K/32]`` -> FP8 1x128 ``(data [M, K], scales [M, K/128])``;
    ``counts`` as for ``mxfp4_to_fp8``."""
    return select(rows).mxfp4_rows_to_fp8(rows, k, counts, out=out)


def quantize_fp8_rows(x, out=None, index=None, scale=None):
    """``[M, K]`` -> packed FP8 rows uint8 ``[M, K + K/128]`` (data bytes, then E8M0 scales).
    ``index``: None, or int64 ``[R]`` on x's device: the ``R`` rows ``x[index]`` (a zero row
    where an index is outside ``[0, M)``) quantized in one pass, without the gathered copy;
    ``scale`` (with ``index``): None, or float32 ``[R]``: each of those rows times its
    factor, rounded to x's dtype (the bytes of that scaled copy's quantization; a zero row
    stays zero whatever its factor)."""
    return select(x).quantize_fp8_rows(x, out=out, index=index, scale=scale)


def dequantize_fp8_rows(rows, dtype=None, k=None, out=None):
    """Packed FP8 rows uint8 ``[M, K + K/128]`` -> ``dtype`` (default bf16) ``[M, K]``."""
    return select(rows).dequantize_fp8_rows(rows, dtype, k, out=out)
