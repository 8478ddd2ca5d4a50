"""Token data: corpora streamed from Parquet or Arrow files, a deterministic sample order,
prefetch off the step's path, corpus preparation, synthetic corpora."""
from __future__ import annotations

from raypar.data.dataset import DataError, TokenDataset
from raypar.data.order import SampleOrder, split_batch
from raypar.data.prepare import prepare_data
from raypar.data.source import open_dataset
from raypar.data.synthetic import write_synthetic_corpus

__all__ = ["DataError", "SampleOrder", "TokenDataset", "open_dataset", "prepare_data", "split_batch",
           "write_synthetic_corpus"]
