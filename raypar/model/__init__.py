"""The model: a Llama-style transformer that builds whole or as pipeline stages."""
from __future__ import annotations

from raypar.model.experts import GroupedExperts, load_unstacked, named_slices, unstacked
from raypar.model.layers import FeedForward, RMSNorm, apply_rope, rope_tables
from raypar.model.partition import PartitionError, build_stage, split_layers, stage_param_names, stage_param_shapes
from raypar.model.transformer import (
    Attention,
    Block,
    Transformer,
    build_mlp,
    flops_per_token,
    init_weights,
    num_params,
    param_dtype,
)

__all__ = [
    "Attention",
    "Block",
    "FeedForward",
    "GroupedExperts",
    "PartitionError",
    "RMSNorm",
    "Transformer",
    "apply_rope",
    "build_mlp",
    "build_stage",
    "flops_per_token",
    "init_weights",
    "load_unstacked",
    "named_slices",
    "num_params",
    "param_dtype",
    "rope_tables",
    "split_layers",
    "stage_param_names",
    "stage_param_shapes",
    "unstacked",
]
