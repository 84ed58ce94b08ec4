"""The tokenizer: a pretrained one by name/folder, or a byte-level BPE trained on the training text.

Training is for random-init models (tests, CPU demo). Rank 0 trains and saves to `run_dir/tokenizer/`;
every rank then loads that folder, so all ranks (and a resumed run) use byte-identical vocabularies.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Optional

from shardtrain.config.settings import Config, ConfigError, where
from shardtrain.data.layouts import read_layout
from shardtrain.data.records import read_texts, split_path
from shardtrain.data.sources import source_of

# RoBERTa's order, so a randomly initialised RobertaModel's pad_token_id=1 default is right.
SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def build_tokenizer(
    cfg: Config,
    run_dir: Path,
    is_rank0: bool,
    barrier: Callable[[], None],
    train_texts: Optional[Callable[[], list[str]]] = None,
):
    """-> PreTrainedTokenizerFast (in transformers 5 that is `TokenizersBackend`). `train_texts`: the training
    text of a source other than the jsonl --data-dir layout (shardtrain/data/sources.py), to train a BPE on."""
    from transformers import AutoTokenizer

    if cfg.data.tokenizer:
        try:
            tok = AutoTokenizer.from_pretrained(cfg.data.tokenizer)
        except Exception as e:  # OSError, ValueError, HFValidationError...: all mean "not usable"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"{where('tokenizer')}: cannot load tokenizer '{cfg.data.tokenizer}': {first}") from None
        if tok.pad_token is None:
            # GPT-style tokenizers have no pad token; batching needs one and the mask hides it anyway.
            if tok.eos_token is None:
                raise ConfigError(f"{where('tokenizer')}: '{cfg.data.tokenizer}' has no pad or eos token")
            tok.pad_token = tok.eos_token
        return tok

    tok_dir = Path(run_dir) / "tokenizer"
    # A resumed run reuses the saved tokenizer: retraining could renumber the vocabulary under the checkpoint.
    if is_rank0 and not (tok_dir / "tokenizer.json").is_file():
        texts = train_texts() if train_texts else training_texts(cfg)[0]
        _save_atomically(train_bpe(texts, cfg.data.tokenizer_vocab_size), tok_dir)
    barrier()
    return AutoTokenizer.from_pretrained(str(tok_dir))


def planned_vocab_size(cfg: Config) -> tuple[int | None, str]:
    """(len(tokenizer), where it comes from) for the tokenizer build_tokenizer would give this config, with no
    run: `shardtrain plan` counts parameters with it. A BPE trained on a small corpus stops short of
    tokenizer_vocab_size (566 of 1000 on the tiny multimodal data), so it is trained here the way the run trains
    it (deterministic; about a second on the tiny data). None: a tokenizer by name not on this machine."""
    from transformers import AutoTokenizer

    if cfg.data.tokenizer:
        try:  # never a download: plan works offline
            return len(AutoTokenizer.from_pretrained(cfg.data.tokenizer, local_files_only=True)), cfg.data.tokenizer
        except Exception:  # noqa: BLE001 - not here: the architecture's own vocabulary stands in
            return None, f"{cfg.data.tokenizer} not found locally"
    try:  # another source than the jsonl layout or a published one is read by the run only (a hub dataset downloads)
        texts, path = training_texts(cfg) if source_of(cfg) == "data_dir" else ([], None)
    except ConfigError:
        path = None
    if path is None:
        return cfg.data.tokenizer_vocab_size, "tokenizer_vocab_size (an upper bound: no training data to train it on)"
    return len(train_bpe(texts, cfg.data.tokenizer_vocab_size)), f"the tokenizer trained on {path}"


def training_texts(cfg: Config) -> tuple[list[str], Path]:
    """(the training split's texts, the file they come from): a published layout's texts and text pairs
    (--dataset-format), else train.jsonl's."""
    if cfg.data.dataset_format:
        layout = read_layout(cfg.data.dataset_format, cfg.data.data_dir)
        rows = layout.splits["train"]
        return [r.text for r in rows] + [r.text_pair for r in rows if r.text_pair], layout.files["train"]
    path = split_path(cfg.data.data_dir, "train")
    return list(read_texts(path)), path


def train_bpe(texts: list[str], vocab_size: int):
    """Byte-level BPE with RoBERTa special tokens and post-processing (`<s> ... </s>`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if not texts:
        raise ConfigError(f"{where('data_dir')}: no usable text in the training split to train a tokenizer on")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols up front: any text is encodable, <unk> never needed.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # The BPE encoders' sequence layout, <s> A </s></s> B </s> with one segment id, and their offsets trimmed of
    # the byte-level spaces: the same ids, segment ids and offsets as tokenizers' RoBERTa processor gives.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=True),
            processors.TemplateProcessing(
                single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        sep_token="</s>",
        cls_token="<s>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<mask>",
    )


def _save_atomically(tok, tok_dir: Path) -> None:
    # Write beside, then rename: a crash mid-save must not leave a half tokenizer that a resume would trust.
    tmp = tok_dir.with_name(tok_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save_pretrained(str(tmp))
    shutil.rmtree(tok_dir, ignore_errors=True)
    tok_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, tok_dir)
