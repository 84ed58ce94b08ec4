"""What the two built-in workloads share: the data a config names (jsonl records or any source of
shardtrain/data/sources.py), a tokenizer, the model section of the config."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from shardtrain.config.labels import ClassLabels
from shardtrain.config.settings import where
from shardtrain.workloads.base import Workload

if TYPE_CHECKING:
    from torch import nn

# torch, the networks and the data pipeline are imported where a method needs them: `shardtrain train --nproc N`'s
# parent process imports the workload classes for their check_before_launch and never trains.


def _rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    from shardtrain.runtime.distributed import barrier

    barrier()


class JsonlWorkload(Workload):
    """train.jsonl / validation.jsonl under data.data_dir (streamed with --streaming), a published layout
    (--dataset-format), or the splits another source gives (--dataset-name, --train-file, --train-dir); in-memory
    splits are tokenised once through datasets.map's cache; the model from `model:`."""

    def __init__(self, cfg, **args):
        super().__init__(cfg, **args)
        self._tokenizer = None
        self._collator = None
        self._train_texts = None  # a source's training text, for the BPE a random-init model trains
        self._labels = None  # set by datasets(), once the data is read

    @property
    def tokenizer(self):
        # Trained on rank 0 into the output dir (or loaded from the hub) the first time it is needed.
        if self._tokenizer is None:
            from shardtrain.data import build_tokenizer

            self._tokenizer = build_tokenizer(
                self.cfg, Path(self.cfg.checkpoint.output_dir), _rank0(), _barrier, self._train_texts
            )
        return self._tokenizer

    def datasets(self):
        from shardtrain.data.sources import source_of

        d = self.cfg.data
        source = source_of(self.cfg)  # asked first, whatever the layout: it is also how the loop knows we read it
        # Records are validated before the tokenizer is trained.
        if d.dataset_format:
            from shardtrain.data.splits import layout_datasets

            train, validation = layout_datasets(self.cfg)
        elif source != "data_dir":
            from shardtrain.data.sources import column_values
            from shardtrain.data.split_dataset import source_datasets

            train, validation = source_datasets(self.cfg)
            self._train_texts = lambda: column_values(train.table, "text")
        else:
            from shardtrain.data.splits import build_split

            if d.streaming:
                from shardtrain.data.streaming import jsonl_train_stream

                train = jsonl_train_stream(self.cfg)
            else:
                train = build_split(self.cfg, "train")
            validation = build_split(self.cfg, "validation")
            # What summary.json and the checkpoints record of the data, as for every other source (sources.py).
            if not d.streaming:
                train.source = jsonl_source(train, validation)
        # The classes the data decided go into this workload's own config, which builds and exports the model;
        # the run's config stays as the user gave it (config/labels.py).
        self._labels = getattr(train, "labels", None) or ClassLabels(self.cfg.model.num_labels, tuple(d.label_names))
        self.cfg = self._labels.applied_to(self.cfg)
        d = self.cfg.data
        # A stream is tokenised in collate, batch by batch (datasets caches no map over a stream); the in-memory
        # splits once, through datasets.map's cache, which a second run on the same data reuses.
        for split, ds in (("train", train), ("validation", validation)):
            if hasattr(ds, "tokenize"):
                done = ds.tokenize(self.tokenizer, d.max_length, d.preprocessing_num_workers, _rank0(), _barrier)
                if _rank0():
                    how = (
                        f"loaded from the datasets cache {done.cache_file.parent}"
                        if done.from_cache
                        else f"tokenised and cached in {done.cache_file.parent}"
                    )
                    cut = f"; {done.truncated:,} longer than {where('max_length')} {d.max_length}, cut to it"
                    print(
                        f"{split}: {len(ds):,} token sequences {how} in {done.seconds:.2f}s"
                        + (cut if done.truncated else ""),
                        flush=True,
                    )
        return train, validation

    def labels(self) -> ClassLabels | None:
        if self._labels is None and self.cfg.data.label_names:
            # predict --file and export read a run's classes from its config: datasets() never runs there
            return ClassLabels(self.cfg.model.num_labels, tuple(self.cfg.data.label_names))
        return self._labels

    def collate(self, samples):
        if self._collator is None:
            from shardtrain.data.splits import make_collator

            self._collator = make_collator(self.cfg, self.tokenizer)
        return self._collator(samples)

    def build_model(self) -> nn.Module:
        import torch

        from shardtrain.builtin_workloads.networks import build_model

        vocab_size = None if self.cfg.model.pretrained else len(self.tokenizer)
        # On the meta device (ranks that receive their weights from rank 0) nothing is loaded from the hub.
        on_meta = torch.get_default_device().type == "meta"
        return build_model(self.cfg.model, self.cfg.data, vocab_size, load_weights=self.loads_weights and not on_meta)

    @classmethod
    def check_before_launch(cls, cfg) -> str | None:
        from shardtrain.builtin_workloads.settings import Builtins
        from shardtrain.config.labels import check_class_metric
        from shardtrain.data.precheck import check_splits
        from shardtrain.runtime.hub import check_hub_names
        from shardtrain.runtime.launch import launch_world_size

        Builtins.check_text_model(cfg)
        # A typo on line 7 of the records, or 3 records for 4 ranks, should not wait for N processes and a model.
        classes = check_splits(cfg, launch_world_size(cfg))
        check_class_metric(cfg, classes)  # --metric-for-best-model f1_<class>, now that the data named the classes
        # Hub names last (the probe may wait seconds): reachable, cached (offline by itself), or one line now.
        return check_hub_names(cfg)

    def memory_model(self):
        from shardtrain.builtin_workloads.memory_model import BuiltinMemoryModel

        # The run's tokenizer once datasets() has read the data (the banner counts the run's own vocabulary);
        # before that (`shardtrain plan`) the vocabulary is planned, and nothing is trained into the run's folder.
        return BuiltinMemoryModel(self.cfg, self.tokenizer if self._labels is not None else None)

    def export_checkpoint(self, ckpt_dir: Path, out_dir: Path, int8: bool) -> dict:
        from shardtrain.builtin_workloads.export import export_builtin

        return export_builtin(ckpt_dir, out_dir, int8)

    def load_exported(self, out_dir: Path, int8: bool) -> nn.Module:
        from shardtrain.builtin_workloads.export import load_builtin_export

        return load_builtin_export(out_dir, int8)

    def freezable_parameter_names(self, n: int) -> list[str]:
        import torch

        with torch.device("meta"):
            return self.build_model().freezable_parameter_names(n)


def jsonl_source(train, validation) -> dict:
    """The jsonl layout's files and the content hash of what was read from them (a stream: not hashed)."""
    from shardtrain.data.sources import content_sha256

    splits = {"train": train, "validation": validation}
    tables = {s: getattr(ds, "table", None) for s, ds in splits.items()}
    return {
        "source": "data_dir",
        **{s: str(ds.path) for s, ds in splits.items() if hasattr(ds, "path")},
        "rows": {s: len(t) for s, t in tables.items() if t is not None},
        "content_sha256": {s: content_sha256(t) for s, t in tables.items() if t is not None},
    }
