"""Tokenisation ahead of training, through `datasets.map` and its cache.

The built-ins' text is tokenised once per (data, tokenizer, max_length), not in every batch: a batched
`datasets.map` writes the token ids to an Arrow file under HF_DATASETS_CACHE, named by the fingerprint of
exactly those three things, and a later run on the same data loads that file instead of tokenising again.

The fingerprint is set here rather than left to `map`: `map` hashes the tokenizer object, and a tokenizer
trained per run (data/tokenizer.py) lives in each run's own output folder. It is keyed by the tokenizer's
content instead, so the same training text gives the same tokenizer and the same cache file.

Only truncation happens here, and each text cut at max_length is marked (`truncated`), so the run can say how
many the model sees only in part, from the cache too; padding stays in collate (to the longest text of each
batch, and to Longformer's window multiple), so the ids a batch holds are those today's tokenize-in-collate
path gives.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from shardtrain.config.settings import ConfigError, where

# Bump when what `Tokenize` writes changes: cache files of the old form must stop matching.
FORMAT_VERSION = 2  # 2: the `truncated` column
CACHE_SUBDIR = "shardtrain-tokenized"


class Tokenize:
    """The batched map function. A class, not a closure, so `num_proc` workers can pickle it."""

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, batch: dict) -> dict:
        # A sentence pair (the canonical `text_pair` column) is tokenised as one input with a separator.
        pair = batch.get("text_pair")
        enc = self.tokenizer(batch["text"], pair, truncation=True, max_length=self.max_length)
        # A fast tokenizer keeps what truncation cut off; exactly max_length tokens is not a cut. A slow one
        # keeps nothing: reaching the limit is the best sign there is.
        if enc.encodings is not None:
            cut = [bool(e.overflowing) for e in enc.encodings]
        else:
            cut = [len(ids) >= self.max_length for ids in enc["input_ids"]]
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "truncated": cut}


def truncated_rows(tokenizer, texts: list[str], pairs: Optional[list[str]], max_length: int) -> list[bool]:
    """Which texts (with their pairs) are longer than max_length and get cut, as Tokenize marks them: for texts
    that are tokenised in collate instead (`predict --file`)."""
    return Tokenize(tokenizer, max_length)({"text": texts, "text_pair": pairs})["truncated"]


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what decides the token ids: the tokenizer's pipeline (normaliser, pre-tokeniser, model,
    post-processor) and special tokens, not its path. Truncation/padding settings are left out: transformers
    changes them on the backend with each call."""
    from datasets.fingerprint import Hasher

    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    backend.pop("truncation", None)
    backend.pop("padding", None)
    return Hasher.hash([type(tokenizer).__name__, backend, tokenizer.all_special_tokens])


def cache_dir() -> Path:
    import datasets

    # datasets reads HF_DATASETS_CACHE when imported; tests point it to a temporary folder.
    return Path(datasets.config.HF_DATASETS_CACHE) / CACHE_SUBDIR


@dataclass
class Preprocessed:
    dataset: "object"  # the datasets.Dataset with input_ids / attention_mask added
    cache_file: Path
    from_cache: bool  # True: loaded from an earlier run's file, no text was tokenised
    seconds: float
    truncated: int  # texts longer than max_length, cut to it


def token_counts(table) -> list[int]:
    """Each row's number of token ids in a table tokenize_table() wrote, read from the Arrow column (no row
    is decoded); a selection of rows is honoured."""
    if table is None or "input_ids" not in table.column_names:
        raise ConfigError(
            f"{where('group_by_length')} needs the training texts' token counts, and this training set has "
            "no token ids: it is tokenised in collate (a stream), or its workload did not tokenise it ahead"
        )
    import pyarrow.compute as pc

    return pc.list_value_length(table.with_format("arrow")[:]["input_ids"]).to_pylist()


def tokenize_table(
    table, tokenizer, max_length: int, num_proc: Optional[int], is_rank0: bool, barrier: Callable[[], None]
) -> Preprocessed:
    """`table` (a datasets.Dataset with a `text` column) with token ids added, through the cache.

    Rank 0 tokenises (or finds the file) first; the other ranks then load the file it wrote, so no two
    processes write the same cache file."""
    from datasets.fingerprint import Hasher

    fingerprint = Hasher.hash([FORMAT_VERSION, table._fingerprint, tokenizer_fingerprint(tokenizer), max_length])
    path = cache_dir() / f"{fingerprint}.arrow"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path.parent).close()  # datasets writes beside the file, then renames
    except OSError as e:
        raise ConfigError(
            f"HF_DATASETS_CACHE: cannot write the tokenised splits in {path.parent} "
            f"({e.strerror}); point HF_DATASETS_CACHE to a writable folder"
        ) from None
    t0 = time.perf_counter()
    # With num_proc, datasets writes one file per worker with a `_0000N_of_0000M` suffix beside `path`.
    from_cache = any(path.parent.glob(f"{fingerprint}*.arrow"))

    def run():
        from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

        was_off = are_progress_bars_disabled()
        disable_progress_bars()  # a "Map" bar per rank and split; the workload prints one line instead
        try:
            return table.map(
                Tokenize(tokenizer, max_length),
                batched=True,
                num_proc=num_proc,
                new_fingerprint=fingerprint,
                cache_file_name=str(path),
                load_from_cache_file=True,
            )
        finally:
            if not was_off:
                enable_progress_bars()

    if is_rank0:
        out = run()
        barrier()
    else:
        barrier()
        out = run()
    import pyarrow.compute as pc

    truncated = pc.sum(out.with_format("arrow")[:]["truncated"]).as_py() or 0
    return Preprocessed(out.remove_columns("truncated"), path, from_cache, time.perf_counter() - t0, truncated)
