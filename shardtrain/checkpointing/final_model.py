"""The model a finished run hands over (`--final-model-dir`; SageMaker's SM_MODEL_DIR becomes model.tar.gz).

Sharded strategies hold no full copy of the weights on any rank, so the consolidated model is made the
one way that works for all of them: commit a checkpoint of the last step (every rank), then rank 0
exports it with shardtrain.checkpointing.export, which reads any strategy's checkpoint in one process.
`--final-model-checkpoint best` exports checkpoints/best instead (the final one is committed all the same).
"""

from __future__ import annotations

from pathlib import Path

from shardtrain.checkpointing import store as checkpoint
from shardtrain.config.settings import logs_model_artifact
from shardtrain.runtime.distributed import barrier


def final_model_folder(cfg) -> Path | None:
    """Where the finished run's model goes: --final-model-dir, else OUT/final_model when W&B is to log it."""
    if cfg.checkpoint.final_model_dir:
        return Path(cfg.checkpoint.final_model_dir)
    if logs_model_artifact(cfg.log):
        return Path(cfg.checkpoint.output_dir) / "final_model"
    return None


def write_final_model(strategy, trainer_state: dict, cfg, console) -> Path | None:
    """Every rank calls this (when final_model_folder(cfg) is set). Returns the folder written on rank 0, else None."""
    out = Path(cfg.checkpoint.output_dir)
    ckpt = checkpoint.checkpoints_root(out) / checkpoint.step_dir_name(trainer_state["step"])
    if not checkpoint.is_committed(ckpt):
        ckpt = checkpoint.save_checkpoint(strategy, trainer_state, out, cfg.checkpoint.keep_last)
    written = None
    if strategy.dist.is_rank0:
        from shardtrain.checkpointing.export import export_checkpoint

        written = final_model_folder(cfg)
        ckpt = chosen_checkpoint(ckpt, cfg, console)
        export_checkpoint(ckpt, written, keep_others=True)
        console.info(f"final model: {written} (from {ckpt})")
    barrier()
    return written


def chosen_checkpoint(final: Path, cfg, console) -> Path:
    """`final`, or with --final-model-checkpoint best the checkpoint `best` names (the final one, with a warning,
    when no evaluation gave a finite value)."""
    if cfg.checkpoint.final_model_checkpoint != "best":
        return final
    best = checkpoint.best_committed(checkpoint.checkpoints_root(cfg.checkpoint.output_dir))
    if best is None:
        console.warn(
            f"--final-model-checkpoint best: no evaluation gave a finite {cfg.train.metric_for_best_model or 'metric'}"
            f", so there is no best checkpoint; the final model is {final}"
        )
    return best or final


def export_final_model_if_missing(ckpt: Path, cfg, is_rank0: bool, console) -> None:
    """A finished run started again (a SageMaker job restarted with the finished run in /opt/ml/checkpoints, or
    a spot interruption between the last checkpoint and the export) trains nothing; an empty final model
    folder would still be uploaded as a "Completed" job's empty model.tar.gz. Every rank calls this."""
    folder = final_model_folder(cfg)
    if folder is None or (folder.is_dir() and any(folder.iterdir())):
        return
    if is_rank0:
        from shardtrain.checkpointing.export import export_checkpoint

        ckpt = chosen_checkpoint(ckpt, cfg, console)
        export_checkpoint(ckpt, folder, keep_others=True)
        console.info(f"final model: {folder} (from {ckpt}: the run had finished)")
    barrier()
