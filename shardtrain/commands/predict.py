"""`shardtrain predict RUN_OR_CHECKPOINT_OR_EXPORT --file new.csv --output preds.jsonl` (or `--split validation`)

The trained model on data: one JSON line per example, in the data's order,

    {"index": 0, "row": 0, "id": "doc-17", "label": "positive", "probs": {"positive": 0.91, "neutral": 0.06},
     "true_label": "neutral"}

`--file F` (csv, json/jsonl or parquet) predicts every row of F, in order, none left out: its columns are the
run's (text, image), the label column is optional and so is each label. `row` is the row's place in its source
(the row of F from 0; for a split, its row in the file it came from); `id` the value of the --id-column (default
`id`, where there is one); `probs` the --top-k most likely classes; `true_label` only where the row has a label.
With labels it also prints the workload's metrics over the labelled rows (accuracy / macro-F1 for a classifier),
computed as training's evaluation computes them, so predicting the run's own validation split (`--split
validation`, the default without --file) reproduces the run's final eval.

The model comes from any strategy's checkpoint (its portable form, checkpointing in one process) or an export
(fp32, or its INT8 copy with --int8), rebuilt through the Workload API: the built-ins and a user's workload alike.
The data is the run's own unless data-source flags (`--data-dir`, `--validation-file`, `--dataset-name`, ...:
any that `train` takes) name other data.

`--nproc N` splits the examples into N contiguous blocks, one per process (torchrun, as `train --nproc` starts
it); this process then joins the blocks in input order. No process group is needed: nothing is exchanged
between the workers, and so no example is padded in or counted twice. preds.jsonl appears only complete:
written to a temporary file beside it, then renamed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shardtrain.config.errors import BadRow
from shardtrain.config.labels import run_config_dict
from shardtrain.config.settings import ConfigError

# The parent process tells its workers where to put their blocks; a worker without it was not started by us.
PARTS_ENV = "SHARDTRAIN_PREDICT_PARTS"
# Fields of the data section that name where the data is; one given on the command line replaces the run's.
SOURCE_FIELDS = (
    "data_dir",
    "dataset_name",
    "dataset_config_name",
    "train_file",
    "validation_file",
    "train_dir",
    "validation_dir",
    "dataset_format",
    "eval_data_dir",
)
# Flags of `train` that predict takes besides the data section: which workload rebuilds the model, and where.
OTHER_FIELDS = ("workload", "workload_args", "device")


class _OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line (a ConfigError), as every shardtrain error is, not argparse's usage block."""

    def error(self, message):
        raise ConfigError(f"predict: {message} (shardtrain predict --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="shardtrain predict",
        allow_abbrev=False,
        description="Predict with a run's model (any strategy's checkpoint, or an "
        "export) on a split of the run's data or of the data that training's data-source flags name.",
        epilog="Data-source flags are train's: --data-dir, --train-file/--validation-file, --dataset-name, "
        "--train-dir/--validation-dir, --dataset-format, column names, --max-eval-samples, ... "
        "(shardtrain train --help lists them).",
    )
    parser.add_argument(
        "source", help="a run's output dir (its latest checkpoint), a checkpoint step dir, or an export folder"
    )
    parser.add_argument(
        "--checkpoint",
        choices=["final", "best"],
        default="final",
        help="of a run's output dir: final (its latest, the model it ended with; the default) or best "
        "(checkpoints/best, which --metric-for-best-model chose)",
    )
    parser.add_argument(
        "--file",
        default=None,
        help="predict every row of this file, in order (csv, json/jsonl, "
        "parquet; the run's text/image columns, labels optional)",
    )
    parser.add_argument(
        "--id-column",
        default=None,
        help="a column copied into each line as `id` (default: `id` where the data has one)",
    )
    parser.add_argument(
        "--split",
        choices=["train", "validation"],
        default=None,
        help="a split of the run's data (or of the data-source flags'): default validation",
    )
    parser.add_argument("--output", default="preds.jsonl", help="one JSON line per example (default: preds.jsonl)")
    parser.add_argument("--top-k", type=int, default=5, help="classes (most likely first) in each line's probs")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the run's eval batch size")
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="autocast dtype (bf16 also on CPU; fp16 on GPU only)",
    )
    parser.add_argument("--int8", action="store_true", help="an export's INT8 copy (export --int8) instead of fp32")
    parser.add_argument("--nproc", type=int, default=1, help="data-parallel processes (one per GPU)")
    parser.add_argument("--verbose", action="store_true", help="show the libraries' warnings and info lines")
    parser.add_argument("--debug", action="store_true", help="a traceback instead of one line on errors")
    return parser


def main(argv: list[str]) -> int:
    """`shardtrain predict`: the cli calls this inside its error guard; user errors raise ConfigError."""
    args, rest = parse_args(argv)
    from shardtrain.runtime.chatter import quiet_libraries

    quiet_libraries(args.verbose)
    source = open_source(args, rest)  # every check that needs no model or data: before any process starts
    if os.environ.get(PARTS_ENV):  # a worker of `--nproc N`
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        predict_block(source, args, rank, world, Path(os.environ[PARTS_ENV]))
        return 0
    from shardtrain.runtime.launch import under_launcher

    if under_launcher():
        raise ConfigError("predict: run it as one plain process; --nproc N starts the N workers itself")
    output = Path(args.output)
    parts = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        if args.nproc > 1:
            code = launch_workers(argv, args.nproc, parts)
            if code != 0:
                return code
        else:
            predict_block(source, args, 0, 1, parts)
        metrics = join_blocks(parts, args.nproc, output, source.workload)
    finally:
        shutil.rmtree(parts, ignore_errors=True)
    what = args.file if args.file else f"the {args.split} split"
    labelled = metrics.pop("_labelled", None)
    rows = metrics.pop("_rows")
    truncated = metrics.pop("_truncated", 0)
    print(f"wrote {rows} predictions of {what} to {output}")
    if truncated:
        from shardtrain.config.settings import where

        length, trained = source.cfg.data.max_length, source.trained_max_length
        if length == trained:
            cut = f"longer than {where('max_length')} {length} were cut to it, as in training"
        else:
            cut = f"longer than predict's --max-length {length} were cut to it, not {trained} as in training"
        print(
            f"predict: {truncated} of {rows} texts {cut} (the model saw their first {length} tokens; `truncated` "
            f"in their lines)"
        )
    if metrics:
        over = f" (over the {labelled} labelled rows)" if labelled is not None and labelled < rows else ""
        print(f"{'file' if args.file else args.split} metrics{over}: {json.dumps(metrics)}")
    elif args.file:
        print(f"no metrics: {args.file} has no labels (column '{source.cfg.data.label_column_name}')")
    return 0


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, dict]:
    """(the parsed flags, {field: value} of the training flags given). Any other training flag is an error."""
    from shardtrain.config.settings import FIELDS, FLAG_ALIASES, flag_of

    parser = build_parser()
    taken = [name for name, (section, _, _) in FIELDS.items() if section == "data" or name in OTHER_FIELDS]
    for name in taken:
        section, _, typ = FIELDS[name]
        extra = {"nargs": "?", "const": "true", "metavar": "{true,false}"} if typ is bool else {}
        parser.add_argument(
            flag_of(name),
            *FLAG_ALIASES.get(name, []),
            dest=name,
            default=None,
            help=f"as in train ({section}.{name})",
            **extra,
        )
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flag = unknown[0].split("=")[0]
        trains = flag == "--config" or flag in {flag_of(n) for n in FIELDS} | {
            a for v in FLAG_ALIASES.values() for a in v
        }
        raise ConfigError(
            f"predict: {flag} is a training setting; the run's own config comes with its checkpoint "
            f"or export, and predict takes only data-source flags (--data-dir, --validation-file, ...), "
            f"--workload, --workload-args and --device"
            if trains
            else f"predict: unknown argument '{unknown[0]}' (shardtrain predict --help)"
        )
    given = {name: getattr(args, name) for name in taken if getattr(args, name) is not None}
    if args.file is not None:
        other = [flag_of(n) for n in SOURCE_FIELDS if n in given]
        if other or args.split is not None:
            raise ConfigError(
                f"predict --file {args.file}: predicts every row of that file; drop "
                f"{(other or ['--split'])[0]} (the data is the file, its columns the run's)"
            )
    if args.split is None:
        args.split = "validation"
    if args.top_k < 1:
        raise ConfigError(f"predict: --top-k must be positive, got {args.top_k}")
    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"predict: --batch-size must be positive, got {args.batch_size}")
    if args.nproc < 1:
        raise ConfigError(f"predict: --nproc must be positive, got {args.nproc}")
    if args.int8 and args.precision != "fp32":
        raise ConfigError(
            f"predict: --int8 runs the quantized model's own int8 kernels; drop --precision {args.precision}"
        )
    output = Path(args.output)
    if output.is_dir():
        raise ConfigError(f"predict: --output {output} is a folder; name the file to write, e.g. {output}/preds.jsonl")
    if not output.parent.is_dir():
        raise ConfigError(f"predict: --output {output}: folder {output.parent} does not exist")
    return args, given


def split_metrics(path: Path, given: dict, int8: bool = False, split: str = "validation") -> dict:
    """The metrics of an export (or checkpoint) on a split of the run's own data, whichever source that was, as
    predict computes them (`export --eval`)."""
    args = argparse.Namespace(
        source=str(path), int8=int8, split=split, file=None, id_column=None, batch_size=None, precision="fp32", top_k=1
    )
    import contextlib
    import io

    source = open_source(args, given)
    # export prints its own lines only: the datasets' cache lines and predict's split note stay out of them.
    with tempfile.TemporaryDirectory(prefix=".eval-", dir=path) as tmp, contextlib.redirect_stdout(io.StringIO()):
        predict_block(source, args, 0, 1, Path(tmp))
        metrics = join_blocks(Path(tmp), 1, Path(tmp) / "preds.jsonl", source.workload)
    for key in ("_labelled", "_rows", "_truncated"):
        metrics.pop(key, None)
    return metrics


# ---- the model and its config ----------------------------------------------------------------------------
@dataclass
class Source:
    cfg: object  # the run's Config, with the command line's data flags over it
    workload: object  # the Workload that rebuilds the model and reads the data
    load_model: object  # () -> nn.Module in eval mode, weights loaded
    label_names: list
    where: str  # the checkpoint or export, for messages
    trained_max_length: int  # the run's data.max_length, which predict's --max-length may change


def open_source(args, given: dict) -> Source:
    source = _open_source(args, given)
    length = source.cfg.data.max_length
    if length > source.trained_max_length:
        # Positions the model never trained, or has none of (RoBERTa's 512): torch's index error otherwise.
        raise ConfigError(
            f"predict --max-length {length}: the model trained at {source.trained_max_length} tokens; predict at "
            f"that length or less"
        )
    return source


def _open_source(args, given: dict) -> Source:
    from shardtrain.checkpointing.export import EXPORT_META

    path = Path(args.source)
    if not path.exists():
        raise ConfigError(f"predict: {path} not found (give a run's output dir, a checkpoint or an export folder)")
    which = getattr(args, "checkpoint", "final")
    if (path / EXPORT_META).is_file():
        if which != "final":
            raise ConfigError(f"predict --checkpoint {which}: {path} is an export, one model; give the run's folder")
        return _export_source(path, args, given)
    if args.int8:
        raise ConfigError(f"predict --int8: {path} is not an export; `shardtrain export {path} OUT --int8` writes one")
    return _checkpoint_source(path, given, which)


def _checkpoint_source(path: Path, given: dict, which: str = "final") -> Source:
    from shardtrain.checkpointing import store as checkpoint

    ckpt = checkpoint.find_checkpoint(path, which, label="predict")
    state = checkpoint.read_trainer_state(ckpt)
    cfg = _with_flags(run_config_dict(state), given, run_dir=ckpt.parent.parent, where=str(ckpt))
    workload = _workload(cfg, (state.get("resolved") or {}).get("workload_import_root"))

    def load_model():
        from shardtrain.checkpointing.export import load_fitting_weights
        from shardtrain.checkpointing.portable import read_portable

        weights = read_portable(ckpt)["model"]
        base = state.get("base")  # a LoRA run's checkpoint leaves its base out: build_model loads it
        model = _build(workload, cfg, load_weights=base is not None)
        return load_fitting_weights(model, weights, workload, f"predict {ckpt}", base).eval()

    trained = _trained_max_length(run_config_dict(state), cfg)
    return Source(cfg, workload, load_model, list(cfg.data.label_names), str(ckpt), trained)


def _export_source(path: Path, args, given: dict) -> Source:
    from shardtrain.checkpointing import store as checkpoint
    from shardtrain.checkpointing.export import EXPORT_META

    try:
        meta = json.loads((path / EXPORT_META).read_text())
    except ValueError as e:
        raise ConfigError(f"predict: {path / EXPORT_META} is not JSON ({e}): a truncated export?") from None
    if "config" in meta:
        saved = meta["config"]
    elif Path(meta.get("checkpoint", "")).is_dir():  # exports written before the meta kept the run's config
        saved = run_config_dict(checkpoint.read_trainer_state(Path(meta["checkpoint"])))
    else:
        raise ConfigError(
            f"predict: {path / EXPORT_META} has no run config and its checkpoint "
            f"{meta.get('checkpoint')} is gone: export the checkpoint again"
        )
    cfg = _with_flags(saved, given, run_dir=path, where=str(path))
    from shardtrain.config.settings import is_builtin_workload, replace_fields

    adapters = meta.get("adapters")  # a LoRA run's export: peft's adapter files, or the merged plain model
    if adapters == "merged":
        cfg = replace_fields(cfg, peft=None)

    if ("model" in meta) != is_builtin_workload(cfg):
        raise ConfigError(
            f"predict --workload: {path} holds {meta.get('model') or meta.get('workload')}'s model, "
            f"which --workload {cfg.workload.workload} cannot rebuild"
        )
    workload = _workload(cfg, meta.get("workload_import_root"))
    names = list(cfg.data.label_names) or [meta["id2label"][str(i)] for i in range(len(meta.get("id2label", {})))]

    def load_model():
        from shardtrain.checkpointing import export

        file = path / (export.INT8_FILE if args.int8 else "model.safetensors")
        own = _readable(lambda: workload.load_exported(path, args.int8), file)  # a layout of the workload's own
        if own is not None:
            return own.eval()
        if args.int8:  # the workload's architecture, the int8 weights assigned (torchao's documented load)
            from shardtrain.workloads.adapters import is_peft_model

            model = _build(workload, cfg)
            if is_peft_model(model):  # a LoRA run's INT8 copy is of the merged model (export_workload)
                model = model.merge_and_unload()
            return export.load_int8_weights(model, path / export.INT8_FILE)
        from safetensors.torch import load_file

        from shardtrain.checkpointing.export import load_fitting_weights
        from shardtrain.workloads.adapters import is_peft_model

        if adapters == "peft":
            return _with_exported_adapters(workload, cfg, path)
        model = _build(workload, cfg)
        if adapters == "merged" and is_peft_model(model):  # build_model's own PeftModel: the merged names
            model = model.merge_and_unload()
        file = path / "model.safetensors"
        if not file.is_file():
            raise ConfigError(
                f"predict: {path} has no model.safetensors: {type(workload).__name__}.export wrote "
                f"its own files; predict from the run's checkpoint instead"
            )
        return load_fitting_weights(
            model, _readable(lambda: load_file(str(file)), file), workload, f"predict {path}"
        ).eval()

    return Source(cfg, workload, load_model, names, str(path), _trained_max_length(saved, cfg))


def _trained_max_length(saved: dict, cfg) -> int:
    return (saved.get("data") or {}).get("max_length") or cfg.data.max_length


def _with_exported_adapters(workload, cfg, path: Path):
    """The base model build_model loads (the pretrained weights the run started from and kept frozen) with the
    export's adapters in it, read as PeftModel.from_pretrained reads them."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    from shardtrain.runtime.training_rng import aside
    from shardtrain.workloads.base import model_of

    file = path / "adapter_model.safetensors"
    with aside(seed=cfg.train.seed):  # a base built from a config (no pretrained weights) is built as training did
        model = model_of(workload)
    result = set_peft_model_state_dict(model, _readable(lambda: load_file(str(file)), file))
    wanted = {k for k, p in model.named_parameters() if p.requires_grad}
    missing = sorted(wanted & set(result.missing_keys))
    if result.unexpected_keys or missing:
        raise ConfigError(
            f"predict: {file} does not fit the adapters of {type(workload).__name__}.build_model(): "
            f"missing {missing[:3]}, unexpected {sorted(result.unexpected_keys)[:3]}"
        )
    return model.eval()


def _readable(load, file: Path):
    """A truncated or foreign file is one line naming it, not a library traceback."""
    try:
        return load()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors / torch errors about the file's bytes
        raise ConfigError(
            f"predict: cannot read {file} (truncated or not this model's?): {' '.join(str(e).split())[:200]}"
        ) from None


def _with_flags(saved: dict, given: dict, run_dir: Path, where: str):
    """The run's saved config with the command line's flags over it, read and checked as `train` reads its own."""
    from shardtrain.config.settings import FIELDS, from_dict, is_builtin_workload, replace_fields, validate

    data = copy.deepcopy(saved)
    sections = {name: data.setdefault(name, {}) or {} for name in ("workload", "data", "parallel")}
    if given.get("workload") not in (None, sections["workload"].get("workload")):
        sections["workload"]["workload_args"] = {}  # another workload: the run's args were for the old one
    if any(name in given for name in SOURCE_FIELDS):
        # Other data: none of the run's own source flags (nor its image cache) describe it. Only a validation
        # file or folder given keeps the run's training data beside it: its classes are that data's.
        only_validation = {n for n in given if n in SOURCE_FIELDS} <= {"validation_file", "validation_dir"}
        kept = {"train_file", "train_dir"} if only_validation else set()
        for name in SOURCE_FIELDS[1:] + ("image_cache",):
            if name not in kept:
                sections["data"][name] = None
    for name, value in given.items():
        sections[FIELDS[name][0]][name] = value
    for val, train in (("validation_file", "train_file"), ("validation_dir", "train_dir")):
        if given.get(val) and not sections["data"].get(train):
            # A run that read a --dataset-name (or another form) has no training file to keep beside it: the
            # given one stands for both splits. Predict reads only its validation split; the classes are the run's
            # (its label_names), whatever the file holds.
            sections["data"][train] = given[val]
    data.update(sections)
    cfg = from_dict(data, source=f"predict's flags over the config of {where}")
    changes = {
        "streaming": False,  # predict reads its split into memory, in order
        # What trained the model is not predict's business: no resume, strategy or output of its own.
        "resume": "none",
        "final_model_dir": None,
        "output_dir": str(run_dir),
        "strategy": "ddp",
        "ds": None,
        "engine_files": False,  # a DeepSpeed run's own files: ddp refuses the setting, and predict reads none
    }
    # The run's own (an export keeps it in its root; a run and older exports in tokenizer/); never a new one
    # trained on the data to predict.
    tokenizer = next((d for d in (run_dir, run_dir / "tokenizer") if (d / "tokenizer.json").is_file()), None)
    if (run_dir / "shardtrain_export.json").is_file() and (run_dir / "tokenizer_config.json").is_file():
        changes["tokenizer"] = str(run_dir)  # what the export hands over, whatever the run named
    elif cfg.data.tokenizer is None and tokenizer is not None:
        changes["tokenizer"] = str(tokenizer)
    cfg = validate(replace_fields(cfg, **changes))
    if is_builtin_workload(cfg) and cfg.data.tokenizer is None:
        raise ConfigError(
            f"predict: {run_dir} has no tokenizer/ folder, and the run trained its own tokenizer; "
            f"pass the one it used with --tokenizer DIR"
        )
    return cfg


def _workload(cfg, import_root: str | None = None):
    """`import_root`: where training imported the workload from (the run's record), after the working directory."""
    from shardtrain.config.settings import add_import_paths
    from shardtrain.workloads.base import load_workload, with_import_root

    add_import_paths(None)  # the `shardtrain` console script's sys.path lacks the working directory
    with_import_root(import_root)
    return load_workload(cfg)


def _build(workload, cfg, load_weights: bool = False):
    from shardtrain.runtime.training_rng import aside
    from shardtrain.workloads.base import model_of

    workload.loads_weights = load_weights  # by default the checkpoint's weights replace any pretrained ones
    try:
        with aside(seed=cfg.train.seed):  # built as training built it, leaving the caller's random numbers alone
            return model_of(workload)
    finally:
        workload.loads_weights = True


# ---- predicting one block of the split ---------------------------------------------------------------------
def block_bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    """Contiguous blocks in input order, sizes differing by at most one: every example in exactly one block."""
    per, extra = divmod(n, world)
    start = rank * per + min(rank, extra)
    return start, start + per + (1 if rank < extra else 0)


def predict_block(source: Source, args, rank: int, world: int, parts: Path) -> None:
    import torch
    from torch.utils.data import DataLoader, Subset

    from shardtrain.data import batch_to_device
    from shardtrain.data.batches import top_tensor
    from shardtrain.data.loaders import loader_workers
    from shardtrain.strategies.base import DTYPES
    from shardtrain.workloads.adapters import forwarded_model
    from shardtrain.workloads.base import CheckedCollate, logits_of

    cfg, workload = source.cfg, source.workload
    device = _device(cfg, args.precision)
    data, rows, ids = predicted_data(source, args)
    start, stop = block_bounds(len(data), rank, world)
    cut = _truncated(workload, data, start, stop, cfg.data.max_length) if args.file is not None else None
    model = source.load_model().to(device)
    loader = DataLoader(
        Subset(data, range(start, stop)),
        batch_size=args.batch_size or cfg.eval_batch_size,
        collate_fn=CheckedCollate(workload),
        num_workers=loader_workers(cfg, world),
    )
    bar = _progress(stop - start, rank)
    sums: dict = {}
    index, names, labelled = start, source.label_names, 0
    with open(parts / f"rank-{rank}.jsonl", "w") as out, torch.no_grad():
        for batch in loader:
            batch = batch_to_device(batch, device)
            with torch.autocast(device.type, dtype=DTYPES[args.precision], enabled=args.precision != "fp32"):
                outputs = workload.forward(forwarded_model(workload, model), batch)
            logits = logits_of(outputs, f"{type(workload).__name__}.forward").float()
            if logits.dim() != 2:
                raise ConfigError(
                    f"predict classifies examples: {type(workload).__name__}.forward gives logits of "
                    f"shape {tuple(logits.shape)}, not [batch, classes]"
                )
            labels = top_tensor(batch, "labels")  # a batch of another shape: no true_label, no metrics
            known = labels.reshape(-1) >= 0 if labels is not None else None
            if known is not None and bool(known.any()):
                # Metrics over the labelled rows only (an unlabelled row of --file has label -1).
                scored = (
                    workload.metric_sums(outputs, batch)
                    if bool(known.all())
                    else workload.metric_sums(logits[known], _rows_of_batch(batch, known))
                )
                for key, value in scored.items():
                    value = value.detach().double().cpu()
                    sums[key] = sums[key] + value if key in sums else value
                labelled += int(known.sum())
            probs = logits.softmax(-1).cpu()
            top = probs.topk(min(args.top_k, probs.shape[-1]), dim=-1)
            for row in range(len(probs)):
                line = {"index": index, "row": rows[index] if rows is not None else index}
                if ids is not None:
                    line["id"] = ids[index]
                line.update(
                    {
                        "label": _name(names, int(top.indices[row, 0])),
                        "probs": {
                            _name(names, int(c)): round(float(p), 6) for p, c in zip(top.values[row], top.indices[row])
                        },
                    }
                )
                if known is not None and bool(known[row]):
                    line["true_label"] = _name(names, int(labels.reshape(-1)[row]))
                if cut is not None and cut[index - start]:
                    line["truncated"] = True  # longer than --max-length: the model saw its first max_length tokens
                out.write(json.dumps(line) + "\n")
                index += 1
            if bar is not None:
                bar.update(len(probs))
    if bar is not None:
        bar.close()
    block = {"rows": index - start, "expected": stop - start, "sums": sums, "labelled": labelled}
    torch.save({**block, "truncated": sum(cut) if cut else 0}, parts / f"rank-{rank}.pt")


def _truncated(workload, data, start: int, stop: int, max_length: int) -> list[bool] | None:
    """Which rows of the block are longer than --max-length: the file's texts are tokenised in collate, which
    cuts them there as training did. None where the workload tokenises no text of this table."""
    from shardtrain.data.preprocess import truncated_rows
    from shardtrain.data.sources import column_values

    tokenizer, table = getattr(workload, "tokenizer", None), getattr(data, "table", None)
    if tokenizer is None or table is None or "text" not in table.column_names:
        return None
    block = table.select(range(start, stop))
    pairs = column_values(block, "text_pair") if "text_pair" in block.column_names else None
    return truncated_rows(tokenizer, column_values(block, "text"), pairs, max_length)


def _rows_of_batch(batch: dict, keep) -> dict:
    n = keep.shape[0]
    return {k: (v[keep] if hasattr(v, "shape") and v.dim() and v.shape[0] == n else v) for k, v in batch.items()}


def predicted_data(source: Source, args) -> tuple:
    """(the Dataset to predict, each example's source row or None, each example's id or None)."""
    from shardtrain.config.settings import is_builtin_workload, reads_images
    from shardtrain.data.sources import column_values
    from shardtrain.workloads.base import splits_of

    cfg, workload = source.cfg, source.workload
    if args.file is not None:
        if not is_builtin_workload(cfg):
            raise ConfigError(
                f"predict --file: {type(workload).__name__} reads its own data (its datasets()); where they come "
                f"from the run's data source (shardtrain.data.load_splits), name a labelled file with "
                f"--validation-file FILE, else other data through its --workload-args; and predict a --split"
            )
        from shardtrain.data.sources import prediction_rows
        from shardtrain.data.split_dataset import SplitDataset

        read = prediction_rows(cfg, args.file, args.id_column)
        if read.empty and os.environ.get("RANK", "0") == "0":
            print(
                f"predict: {len(read.empty)} row{'s' if len(read.empty) > 1 else ''} of {args.file} "
                f"{'have' if len(read.empty) > 1 else 'has'} no text, e.g. {read.row_names(read.empty[0])}: "
                f"predicted from the special tokens alone (training refuses such rows as bad)",
                flush=True,
            )
        # Not tokenised ahead: collate tokenises (truncating at data.max_length) as the ahead-of-time map does.
        data = SplitDataset(
            read.table, read.origin, cfg.data.image_size, reads_images(cfg), [], row_names=read.row_names
        )
        return data, column_values(read.table, "row"), read.ids
    try:
        train, validation = splits_of(workload)
    except BadRow as e:
        raise BadRow(
            f"{e} (predict reads a --split as training does; --file F predicts every row of F, one without a label "
            f"or a text too)"
        ) from None
    data = train if args.split == "train" else validation
    if data is None:
        raise ConfigError(
            f"predict --split {args.split}: {type(workload).__name__}.datasets() has no {args.split} "
            f"split for this data"
        )
    left_out = getattr(data, "skipped", None) or []
    if left_out and os.environ.get("RANK", "0") == "0":  # 4 of 30 rows had gone missing without a word
        print(
            f"predict: --skip-bad-samples left {len(left_out)} rows of the {args.split} split out, e.g. "
            f"{left_out[0]}; --file F predicts every row of F, unlabelled ones too",
            flush=True,
        )
    held = (getattr(data, "source", None) or {}).get("validation_split")
    if held and os.environ.get("RANK", "0") == "0":
        pct = held["percentage"] if args.split == "validation" else 100 - held["percentage"]
        print(
            f"predict: the {args.split} split is {pct}% of the run's training rows, shuffled (--validation-split-"
            f"percentage {held['percentage']}, seed {held['seed']}): each line's `row` says which row it is; "
            f"--file F predicts every row of F in order",
            flush=True,
        )
    table = getattr(data, "table", None)
    column = next((c for c in ("row", "line") if table is not None and c in table.column_names), None)
    rows = column_values(table, column) if column else None
    if column == "line":  # the jsonl layout's records keep their file line (from 1, for its error lines)
        rows = [line - 1 for line in rows]
    return data, rows, _split_ids(cfg, data, args.split, rows, args.id_column)


def _split_ids(cfg, data, split: str, rows, id_column):
    """The id column of the rows a source split came from (a file, a dataset), looked up by their row."""
    from shardtrain.data.sources import column_values, read_raw, source_of

    kind = source_of(cfg) if not cfg.data.dataset_format else "dataset_format"
    if rows is None or kind in ("data_dir", "dataset_format") or not hasattr(data, "source"):
        if id_column is not None:
            raise ConfigError(
                f"predict --id-column {id_column}: the {split} split's rows have no columns besides "
                f"text and label (the jsonl layout, or a workload's own data)"
            )
        return None
    raw = read_raw(cfg, kind)
    origin = raw[split] if raw.get(split) is not None else raw["train"]  # a held-out validation split: train's rows
    name = id_column or "id"
    if name not in origin.ds.column_names:
        if id_column is not None:
            raise ConfigError(
                f"predict --id-column {id_column}: no column '{id_column}' in {origin.origin} "
                f"(columns: {', '.join(origin.ds.column_names)})"
            )
        return None
    values = column_values(origin.ds, name)
    return [values[r] for r in rows]


def _device(cfg, precision: str):
    import torch

    from shardtrain.runtime.distributed import resolve_device_type

    kind = resolve_device_type(cfg.parallel.device)
    if precision == "fp16" and kind != "cuda":
        raise ConfigError("predict --precision fp16: half-precision kernels are a GPU's; on CPU use bf16 or fp32")
    return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if kind == "cuda" else "cpu")


def _name(names: list, i: int) -> str:
    return names[i] if 0 <= i < len(names) else str(i)


def _progress(total: int, rank: int):
    """A bar on a terminal (rank 0 only); nothing in a log file or a pipe."""
    if rank != 0 or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="ex", desc="predict", file=sys.stderr, dynamic_ncols=True)


# ---- several processes, then one file --------------------------------------------------------------------
def launch_workers(argv: list[str], nproc: int, parts: Path) -> int:
    """`--nproc N`: the same command in N torchrun workers (shardtrain/runtime/launch.py), each writing its block."""
    from shardtrain.runtime.launch import launch_local, without_flag

    rest = without_flag(argv, "--nproc")
    return launch_local(
        nproc,
        ["-m", "shardtrain", "predict", *rest],
        shown=f"-m shardtrain predict {shlex.join(rest)}",
        extra_env={PARTS_ENV: str(parts)},
    )


def join_blocks(parts: Path, world: int, output: Path, workload) -> dict:
    """The blocks in rank order (= input order) into `output`, through a temporary file and a rename; the
    workload's metrics over the summed metric_sums (with labels). Returns the metrics and `_rows`."""
    import torch

    from shardtrain.checkpointing.export import normal_mode

    rows, sums, labelled, truncated = 0, {}, 0, 0
    tmp = tempfile.NamedTemporaryFile("w", dir=output.parent, prefix=f".{output.name}.", suffix=".tmp", delete=False)
    try:
        with tmp:
            for rank in range(world):
                done = parts / f"rank-{rank}.pt"
                if not done.is_file():
                    raise ConfigError(f"predict: worker {rank} of {world} wrote no predictions")
                block = torch.load(done, weights_only=True)
                if block["rows"] != block["expected"]:
                    raise ConfigError(
                        f"predict: worker {rank} predicted {block['rows']} of its {block['expected']} examples"
                    )
                with open(parts / f"rank-{rank}.jsonl") as f:
                    shutil.copyfileobj(f, tmp)
                rows += block["rows"]
                labelled += block.get("labelled", 0)
                truncated += block.get("truncated", 0)
                for key, value in block["sums"].items():
                    sums[key] = sums[key] + value if key in sums else value
        normal_mode(Path(tmp.name))  # the mode open() would give preds.jsonl, not mkstemp's 0600
        os.replace(tmp.name, output)
    except BaseException:
        Path(tmp.name).unlink(missing_ok=True)
        raise
    metrics = workload.metrics(sums) if sums else {}
    return {**metrics, "_rows": rows, "_labelled": labelled, "_truncated": truncated}
