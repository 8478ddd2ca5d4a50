"""Sharded, topology-free checkpoints: write pieces per worker, commit atomically, load
with resharding, export Hugging Face style.

Typical save: every worker calls ``write_shard`` for the pieces it owns; the coordinator
collects the results, builds a ``Manifest`` with ``merge_entries`` and calls ``commit``.
Typical load: ``CheckpointReader(resolve(root, "latest")).read(name, offsets, shape)``.
"""
from .export import DEFAULT_EXCLUDED_PREFIXES, export_hf, is_model_weight
from .manifest import (
    FORMAT_VERSION,
    CheckpointError,
    Manifest,
    PieceEntry,
    TensorEntry,
    dtype_from_name,
    dtype_name,
)
from .pieces import FlatPieces, flat_range_boxes, piece_name, split_piece_name
from .reader import CheckpointReader, ReadOp, plan_reads
from .store import (
    MANIFEST_NAME,
    checkpoint_dir,
    cleanup_uncommitted,
    commit,
    is_committed,
    latest,
    list_committed,
    newest_verified,
    read_manifest,
    resolve,
    rotate,
    set_aside,
    verify,
)
from .writer import merge_entries, piece_key, write_shard

__all__ = [
    "DEFAULT_EXCLUDED_PREFIXES",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "CheckpointError",
    "CheckpointReader",
    "FlatPieces",
    "Manifest",
    "PieceEntry",
    "ReadOp",
    "TensorEntry",
    "checkpoint_dir",
    "cleanup_uncommitted",
    "commit",
    "dtype_from_name",
    "dtype_name",
    "export_hf",
    "flat_range_boxes",
    "is_committed",
    "is_model_weight",
    "latest",
    "list_committed",
    "merge_entries",
    "newest_verified",
    "piece_key",
    "piece_name",
    "plan_reads",
    "read_manifest",
    "resolve",
    "rotate",
    "set_aside",
    "split_piece_name",
    "verify",
    "write_shard",
]
