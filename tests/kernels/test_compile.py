"""Every Triton kernel variant compiles for a GPU (sm_90) on a machine without one.

The interpreter runs the kernels as Python and accepts code the compiler rejects (a loop-carried
value changing type, a branch the compiler cannot lower); compiling ahead of time for an H100
target, with the ptxas that Triton ships, catches that without a GPU.
"""

from __future__ import annotations

from pathlib import Path

from tests.kernels.sm90 import compile_in_subprocess, compile_sm90

# attention variants: (activation dtype, cache dtype, split-KV partials, visibility from cell
# metadata, sliding-window kind as an index in kernels.visibility.SWA_KINDS)
ATTENTION = [
    ("fp16", "fp16", False, False, 0),  # fp16 dots, one pass, dense mask
    ("fp16", "fp16", True, False, 0),  # flash-decoding partials
    ("fp32", "bf16", True, False, 0),  # fp32 activations on a bf16 cache: fp32 dots
    ("fp16", "fp16", False, True, 0),  # cell metadata: a prompt
    ("fp32", "bf16", True, True, 1),  # cell metadata, a window, split decode
    ("bf16", "bf16", False, True, 2),  # chunked window
    ("fp32", "fp16", True, True, 3),  # symmetric window
]


# quantized caches: (K type, V type, split, cells) as kv_quant.C_IDS names: an affine K (the
# query's block sums), the table type, a one-byte type
QUANTIZED = [("q4_1", "iq4_nl", False, False), ("q8_0", "q5_0", True, True), ("iq4_nl", "q5_1", True, False)]


def compile_all() -> None:  # runs in `compile_in_subprocess`
    from kvtool.kernels import attention_split, attention_triton, kv_triton, store_kv
    from kvtool.kernels.kv_quant import C_IDS, KV_TYPES

    def build(fn, pointers: dict[str, str], constexprs: dict[str, object], **options) -> None:
        # every argument that is neither a pointer nor a constexpr is an int32, but the scale
        scalar = {name: "fp32" if name == "qk_scale" else "i32" for name in fn.arg_names}
        signature = scalar | {name: "*" + t for name, t in pointers.items()}
        signature |= {name: "constexpr" for name in constexprs}
        compile_sm90(fn, signature, constexprs, **options)

    partials = dict(m_ptr="fp32", l_ptr="fp32", acc_ptr="fp32")
    meta = dict(cpos_ptr="i64", cseq_ptr="i64", qpos_ptr="i64", qseq_ptr="i64")
    extra = dict(table_ptr="fp32", qs_ptr="fp32")
    blocks = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_D=128, BLOCK_DV=128)
    floats = dict(KT=0, VT=0, BBK=0, BBV=0, NB=16)
    for q, kv, split, cells, swa in ATTENTION:
        pointers = dict(q_ptr=q, k_ptr=kv, v_ptr=kv, mask_ptr="fp32", o_ptr=q, **meta, **partials, **extra)
        modes = dict(CELLS=cells, SWA=swa, CAUSAL=True)
        constexprs = dict(F16=q == kv == "fp16", SPLIT=split, **modes, **blocks, **floats)
        build(attention_triton._attention_kernel, pointers, constexprs, num_stages=3)
    for tk, tv, split, cells in QUANTIZED:
        pointers = dict(
            q_ptr="fp32", k_ptr="u8", v_ptr="u8", mask_ptr="fp32", o_ptr="fp32", **meta, **partials
        )
        a, b = KV_TYPES[tk], KV_TYPES[tv]
        types = dict(KT=C_IDS[tk], VT=C_IDS[tv], BBK=a.block_bytes, BBV=b.block_bytes, NB=16)
        modes = dict(CELLS=cells, SWA=0, CAUSAL=True)
        constexprs = dict(F16=False, SPLIT=split, **modes, **blocks, **types)
        build(attention_triton._attention_kernel, pointers | extra, constexprs, num_stages=3)
    for t in (t for t in KV_TYPES.values() if t.quantized):
        pointers = dict(dst_ptr="u8", src_ptr="fp32", idx_ptr="i64", table_ptr="fp32")
        build(kv_triton._store_blocks_kernel, pointers, dict(TYPE=C_IDS[t.name], BB=t.block_bytes))
    reduce = attention_split._attention_reduce_kernel
    build(reduce, dict(o_ptr="bf16", **partials), dict(BLOCK_M=16, BLOCK_DV=128))
    build(store_kv._store_kv_kernel, dict(dst_ptr="bf16", src_ptr="fp32", idx_ptr="i64"), dict(BLOCK=1024))


def test_kernels_compile_for_sm90(tmp_path: Path) -> None:
    compile_in_subprocess("tests.kernels.test_compile", "compile_all", tmp_path)
