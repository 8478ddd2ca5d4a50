"""Sharded, topology-free checkpoints: write pieces per worker, commit atomically, load
with resharding, export Hugging Face style.

Typical save: every worker calls ``write_shard`` for the pieces it owns; the coordinator
collects the results, builds a ``Manifest`` with ``merge_entries`` and calls ``commit``.
Typical load: ``CheckpointReader(resolve(root, "latest")).read(name, offsets, shape)``.
"""
import importlib

# Each name's module, imported on first use: the writer actor that commits checkpoints
# (manifest, store) then starts without torch, whose import is most of its start-up.
_MODULES = {
    "export": ["DEFAULT_EXCLUDED_PREFIXES", "export_hf", "is_model_weight"],
    "manifest": ["FORMAT_VERSION", "CheckpointError", "Manifest", "PieceEntry", "TensorEntry", "dtype_from_name",
                 "dtype_name", "merge_entries"],
    "pieces": ["FlatPieces", "flat_range_boxes", "piece_name", "split_piece_name"],
    "reader": ["CheckpointReader", "ReadOp", "plan_reads"],
    "store": ["MANIFEST_NAME", "checkpoint_dir", "cleanup_uncommitted", "commit", "is_committed", "latest",
              "list_committed", "newest_verified", "read_manifest", "resolve", "rotate", "set_aside", "verify"],
    "writer": ["piece_key", "write_shard"],
}
_MODULE_OF = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = sorted(_MODULE_OF)
