"""The token dataset a run trains on: the configured file, or a synthetic corpus it generates."""
from __future__ import annotations

from pathlib import Path

from raypar.config import Config
from raypar.data.dataset import DataError, TokenDataset
from raypar.data.synthetic import write_synthetic_corpus


def open_dataset(cfg: Config, run_dir: Path) -> TokenDataset:
    """`data.path`, or (without one) a synthetic corpus generated once into `run_dir/data`;
    checked against the model's vocabulary and the global batch."""
    d = cfg.data
    if d.path is None:
        path = run_dir / "data" / f"synthetic-v{cfg.model.vocab_size}-t{d.seq_len}-n{d.synthetic_samples}-s{cfg.train.seed}.parquet"
        if not path.exists():
            write_synthetic_corpus(path, d.synthetic_samples, d.seq_len, cfg.model.vocab_size, seed=cfg.train.seed)
    else:
        path = Path(d.path).expanduser().resolve()
    dataset = TokenDataset(path, d.seq_len)
    dataset.check_vocab(cfg.model.vocab_size)
    if len(dataset) < cfg.train.global_batch_size:
        raise DataError(
            f"{path} holds {len(dataset)} samples, fewer than one global batch "
            f"(train.global_batch_size={cfg.train.global_batch_size})"
        )
    return dataset
