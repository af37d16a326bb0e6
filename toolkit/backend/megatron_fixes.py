"""A megatron-core 0.16.1 bug dsmt works around on every machine, GPU or CPU.

`megatron/core/transformer/moe/moe_utils.py` imports `te_general_gemm` and the `fused_*` MoE helpers inside
`try: import transformer_engine`, and its `except ImportError` branch sets only `HAVE_TE = False`. The router
then calls `te_general_gemm` by name whenever its fp32 gating path is asked for and fails with
`NameError: name 'te_general_gemm' is not defined` (moe_utils.py:1192, `RouterGatingLinearFunction`), and the
fused helpers are tested with `fused_x is None`, another NameError. Without Transformer Engine the names are set
to None, which is what the code tests for; with it nothing is touched.
"""

from __future__ import annotations

TE_NAMES = ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
            "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
            "fused_topk_with_score_function", "fused_unpermute")


def define_missing_te_names() -> list[str]:
    """Set the Transformer Engine names moe_utils lacks to None; returns the names set."""
    from megatron.core.transformer.moe import moe_utils

    if moe_utils.HAVE_TE:
        return []
    missing = [name for name in TE_NAMES if not hasattr(moe_utils, name)]
    for name in missing:
        setattr(moe_utils, name, None)
    return missing
