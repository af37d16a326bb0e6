"""The megatron-core 0.16.1 bugs dsmt works around on every machine without Transformer Engine, GPU or CPU.

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


class _NotInstalled:
    """Stands for a Transformer Engine class that is not installed: nothing is an instance of it."""


def define_missing_mla_te_classes() -> list[str]:
    """`megatron/core/transformer/multi_latent_attention.py` tests `isinstance(self.linear_proj, TELinear)` when
    building every MLA layer (line 185). Without Transformer Engine, megatron's `extensions.transformer_engine`
    hands out MagicMock placeholders for its classes (so the import succeeds and `HAVE_TE` is True there), and
    isinstance against a mock instance fails: `TypeError: isinstance() arg 2 must be a type`. Each such name that is
    not a class becomes a class nothing is an instance of (the `in [TELinear]` tests keep answering False); with TE
    (real classes) nothing is touched."""
    from megatron.core.transformer import multi_latent_attention

    missing = [name for name in ("TELinear", "TEColumnParallelLinear")
               if not isinstance(getattr(multi_latent_attention, name, None), type)]
    for name in missing:
        setattr(multi_latent_attention, name, _NotInstalled)
    if not isinstance(getattr(multi_latent_attention, "Linear", None), type):
        # Imported in the same `try` as TE's names: megatron's plain local Linear, which dsmt's local MLA layers use
        # for the down projections (toolkit/adapters/layer_specs.py), must be the class MLA compares with.
        from megatron.core.post_training.modelopt.layers import Linear

        multi_latent_attention.Linear = Linear
        missing.append("Linear")
    return missing
