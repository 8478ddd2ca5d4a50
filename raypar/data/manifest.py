"""A token corpus's manifest: what `prepare-data` wrote into a folder of Parquet shards.

`manifest.json` sits beside the shards and is written last, so a folder with one is
complete. Readers take the shard list, the sample counts (no footer reads needed to
index the corpus) and the facts a run checks against its config (seq_len, vocabulary,
tokenizer) from it; a folder without one is read by listing its `*.parquet` files.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from raypar.data.shards import DataError

__all__ = ["MANIFEST_NAME", "FORMAT", "CorpusManifest", "ShardEntry"]

MANIFEST_NAME = "manifest.json"
FORMAT = "raypar-tokens/1"


@dataclass(frozen=True)
class ShardEntry:
    path: str  # relative to the manifest's folder
    samples: int
    bytes: int
    sha256: str  # of the whole file


@dataclass(frozen=True)
class CorpusManifest:
    seq_len: int  # each row holds seq_len + 1 tokens
    vocab_size: int  # the tokenizer's vocabulary; every id is below it
    tokenizer: str  # "bytes" or the tokenizer.json it was made with
    tokenizer_fingerprint: str  # "bytes" or "sha256:<hex of tokenizer.json>"
    eos_id: int  # -1: documents were not separated
    documents: int
    samples: int
    tokens: int  # samples x (seq_len + 1)
    max_token: int
    shards: list[ShardEntry] = field(default_factory=list)
    format: str = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, where: str) -> "CorpusManifest":
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT!r}")
            shards = [ShardEntry(**s) for s in raw.pop("shards")]
            manifest = cls(**raw, shards=shards)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise DataError(f"{where} is not a raypar corpus manifest ({exc}); rewrite the corpus with "
                            "`raypar prepare-data`, or remove the manifest to read the folder's *.parquet files") from None
        if sum(s.samples for s in manifest.shards) != manifest.samples:
            raise DataError(f"{where}: the shards hold {sum(s.samples for s in manifest.shards)} samples but the "
                            f"manifest says {manifest.samples}; the corpus is damaged, write it again")
        return manifest
