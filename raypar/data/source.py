"""The token corpus a run trains on: the configured one, or a synthetic corpus it generates."""
from __future__ import annotations

from pathlib import Path

from raypar.checkpoint import storage
from raypar.config import Config
from raypar.data.dataset import DataError, TokenDataset
from raypar.data.synthetic import write_synthetic_corpus

__all__ = ["open_corpus", "open_dataset"]


def open_corpus(cfg: Config, path: storage.Location) -> TokenDataset:
    """The corpus at `path`, opened as `cfg.data` says and checked against the model (the
    vocabulary: now where the corpus declares its ids, else as blocks are read) and the
    tokenizer `data.tokenizer` names."""
    d = cfg.data
    dataset = TokenDataset(path, d.seq_len, window_bytes=max(1, int(d.window_mb * 2**20)))
    dataset.check_vocab(cfg.model.vocab_size)
    if d.tokenizer is not None:
        from raypar.data.prepare import tokenizer_fingerprint

        dataset.check_tokenizer(tokenizer_fingerprint(d.tokenizer))
    return dataset


def open_dataset(cfg: Config, run_dir: Path) -> TokenDataset:
    """`data.path`, or (without one) a synthetic corpus generated once into `run_dir/data`;
    checked against the model and the global batch."""
    d = cfg.data
    if d.path is None:
        path = run_dir / "data" / f"synthetic-v{cfg.model.vocab_size}-t{d.seq_len}-n{d.synthetic_samples}-s{cfg.train.seed}.parquet"
        if not path.exists():
            write_synthetic_corpus(path, d.synthetic_samples, d.seq_len, cfg.model.vocab_size, seed=cfg.train.seed)
    else:
        path = d.path if storage.is_uri(d.path) else Path(d.path).expanduser().resolve()
    dataset = open_corpus(cfg, path)
    if len(dataset) < cfg.train.global_batch_size:
        raise DataError(
            f"{dataset.shown} holds {len(dataset)} samples, fewer than one global batch "
            f"(train.global_batch_size={cfg.train.global_batch_size})"
        )
    return dataset
