"""The ctypes signature of every function the kernel library exports: argument
types and result type, applied when the library is loaded (build.py). The
kernels trust them as they trust pointers: an argument too many or of the wrong
width shifts every argument after it, so tests/kernels/test_signatures.py
checks each against its ``extern "C"`` declaration in the C++."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# name: (argument types, result type; None: void)
SIGNATURES: dict[str, tuple[Sequence[type], type | None]] = {
    "paged_decode_f32": ([_ptr] * 4 + [_i64] * 8 + [_f32, _i64, _f32, _ptr, _ptr], None),
    "paged_decode_bf16": ([_ptr] * 4 + [_i64] * 8 + [_f32, _i64, _f32, _ptr, _ptr], None),
    "paged_decode_quant": ([_ptr] * 4 + [_i64] * 13 + [_f32, _i64, _f32, _ptr, _ptr], None),
    "prefill_attention_f32": ([_ptr] * 3 + [_i64] * 10 + [_ptr, _ptr, _f32, _f32, _ptr, _ptr], None),
    "prefill_attention_quant": ([_ptr] * 2 + [_i64] * 10 + [_ptr, _ptr] + [_i64] * 4 + [_f32, _f32, _ptr, _ptr], None),
    "prefill_attention_supports": ([_i64, _i64], ctypes.c_int),
    "prefill_attention_bf16": ([_ptr] * 3 + [_i64] * 10 + [_ptr, _ptr, _f32, _f32, _ptr, _ptr], None),
    "prefill_attention_bf16_supports": ([_i64, _i64], ctypes.c_int),
    "kv_quantize": ([_ptr, _i64, _i64, _ptr] + [_i64] * 4 + [_ptr], None),
    "rms_norm_f32": ([_ptr, _i64, _ptr, _ptr, _i64, _i64, _f32, _ptr], None),
    "silu_mul_f32": ([_ptr, _i64, _i64, _ptr], None),
    "rope_f32": ([_ptr] + [_i64] * 4 + [_ptr, _ptr], None),
    "rms_norm_bf16": ([_ptr, _i64, _ptr, _ptr, _i64, _i64, _f32, _ptr], None),
    "rms_norm_heads_f32": ([_ptr, _i64, _i64, _i64, _ptr, _i64, _f32], None),
    "rms_norm_heads_bf16": ([_ptr, _i64, _i64, _i64, _ptr, _i64, _f32], None),
    "silu_mul_bf16": ([_ptr, _i64, _i64, _ptr], None),
    "gelu_tanh_mul_f32": ([_ptr, _i64, _i64, _ptr], None),
    "gelu_tanh_mul_bf16": ([_ptr, _i64, _i64, _ptr], None),
    "rope_bf16": ([_ptr] + [_i64] * 4 + [_ptr, _ptr], None),
    "rope_partial_f32": ([_ptr] + [_i64] * 5 + [_ptr, _ptr], None),
    "rope_partial_bf16": ([_ptr] + [_i64] * 5 + [_ptr, _ptr], None),
    "hadamard_f32": ([_ptr] + [_i64] * 4 + [_f32], None),
    "linear_packed_f32": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr], None),
    "linear_packed_bf16": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr], None),
    "linear_packed_bf16_out": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr], None),
    "linear_panel_width": ([], _i64),
    "linear_bf16_tiles": ([], _i64),
    "quant_linear_f32": ([_ptr, _i64, _i64, _i64, _ptr] + [_i64] * 5 + [_ptr, _ptr], None),
    "quant_dequantize_f32": ([_ptr] + [_i64] * 4 + [_ptr] + [_i64] * 3 + [_ptr], None),
    "quant_peak_ops": ([_i64], _i64),
    "llama_decode_layers": ([_ptr, _i64, _ptr, _ptr] + [_i64] * 6 + [_f32] + [_ptr] * 7 + [_f32, _f32, _i64], None),
    "moe_route_f32": ([_ptr, _i64, _i64, _i64, _i64, _f32, _ptr, _ptr], None),
    "sigmoid_f32": ([_ptr, _i64, _ptr], None),
    "shm_barrier": ([_ptr, _i64, _i64, _i64, _i64, _ptr, ctypes.c_double], _i64),
}
