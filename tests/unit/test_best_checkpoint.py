"""The best checkpoint and early stopping in one process: HF Trainer's rule, checked against HF's
own code; the metric's name and its one-line errors; the record a resume continues; the start-up refusals;
`checkpoints/best` written at the commit and never pruned; `--checkpoint best|final`; the report's line. The real
2-process runs (four strategies, kill -9 and resume) are in tests/dist/test_checkpoints.py."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from shardtrain.checkpointing import store as checkpoint
from shardtrain.config.settings import ConfigError, TrainConfig, parse_cli
from shardtrain.loop.best import BestCheckpoint, Record, judge, stopped_early
from shardtrain.loop.saves import Saves

METRICS = {"accuracy": 0.5, "macro_f1": 0.4, "n_examples": 64}


class Console:
    rank = 0

    def __init__(self):
        self.lines, self.warnings = [], []

    def info(self, msg):
        self.lines.append(msg)

    def warn(self, msg):
        self.warnings.append(msg)


def tracker(saved=None, **train) -> BestCheckpoint:
    return BestCheckpoint(TrainConfig(eval_every=1, **train), saved, "Task", Console())


# ---- the rule ------------------------------------------------------------------------------------------------
def test_judge_follows_hf_new_best_at_any_gain_patience_reset_only_above_the_threshold():
    r = Record("accuracy", greater_is_better=True)
    r = judge(r, 1, 0.50, threshold=0.01)
    assert (r.step, r.value, r.evals_without_improvement) == (1, 0.50, 0)  # the first finite value
    r = judge(r, 2, 0.505, threshold=0.01)  # better, but by less than the threshold: best, and counted
    assert (r.step, r.value, r.evals_without_improvement) == (2, 0.505, 1)
    r = judge(r, 3, 0.505, threshold=0.01)  # equal: neither
    assert (r.step, r.evals_without_improvement) == (2, 2)
    r = judge(r, 4, float("nan"), threshold=0.01)  # non-finite: never best, counted
    assert (r.step, r.evals_without_improvement) == (2, 3)
    r = judge(r, 5, 0.60, threshold=0.01)
    assert (r.step, r.value, r.evals_without_improvement) == (5, 0.60, 0)
    low = judge(judge(Record("loss", greater_is_better=False), 1, 2.0, 0.0), 2, 1.5, 0.0)
    assert (low.step, low.value) == (2, 1.5)
    assert judge(Record("x", True), 1, float("inf"), 0.0).step is None  # not even as the first value


def test_judge_agrees_with_hf_trainer_and_its_early_stopping_callback():
    """HF's own code on random sequences: EarlyStoppingCallback.check_metric_value, then Trainer's
    _determine_best_metric, in the order HF's Trainer calls them (the callback sees the best before the update)."""
    from transformers import Trainer, TrainerControl, TrainerState
    from transformers.trainer_callback import EarlyStoppingCallback
    from transformers.trainer_utils import SaveStrategy

    rng = random.Random(0)
    for trial in range(40):
        greater, threshold = trial % 2 == 0, rng.choice([0.0, 0.01, 0.05])
        values = [round(rng.uniform(0, 1), rng.choice([1, 2])) for _ in range(12)]
        args = SimpleNamespace(greater_is_better=greater, metric_for_best_model="m", save_strategy=SaveStrategy.STEPS)
        hf = SimpleNamespace(args=args, state=TrainerState())
        callback = EarlyStoppingCallback(early_stopping_patience=3, early_stopping_threshold=threshold)
        ours = Record("m", greater)
        for step, value in enumerate(values, 1):
            hf.state.global_step = step
            callback.check_metric_value(args, hf.state, TrainerControl(), value)
            Trainer._determine_best_metric(hf, {"eval_m": value}, trial=None)
            ours = judge(ours, step, value, threshold)
            assert ours.evals_without_improvement == callback.early_stopping_patience_counter, (values, step)
            assert (ours.value, ours.step) == (hf.state.best_metric, hf.state.best_global_step), (values, step)


# ---- the Trainer's part --------------------------------------------------------------------------------------
def test_the_default_metric_is_the_first_key_and_patience_stops_the_run():
    best = tracker(early_stopping_patience=2)
    best.observe(2, METRICS)
    assert best.record.metric == "accuracy" and best.record.greater_is_better and best.saves_at(2)
    best.observe(4, {**METRICS, "accuracy": 0.5})
    assert not best.saves_at(4) and not best.stop
    best.observe(6, {**METRICS, "accuracy": 0.4})
    assert best.stop and best.record.step == 2 and best.record.evals_without_improvement == 2
    assert "step 6: early stopping: accuracy did not improve" in best.stop_line(6)
    assert best.summary()["checkpoint"] == "step-000002" and best.summary()["patience"] == 2


def test_a_new_best_within_the_threshold_says_it_counts_against_the_patience():
    """`new best ... (was 0.873)` and then `early stopping: did not improve by more than 0.001` at the same step
    read as a contradiction: HF's rule (a new best at any gain, an improvement only above the threshold) is now
    said on the new best's line."""
    best = tracker(early_stopping_patience=1, early_stopping_threshold=0.01)
    best.observe(2, METRICS)
    best.observe(4, {**METRICS, "accuracy": METRICS["accuracy"] + 0.005})
    line = best.console.lines[-1]
    assert line.endswith(
        "checkpoints/best; not better by more than 0.01 (--early-stopping-threshold): 1 of 1 evaluations without "
        "an improvement"
    ), line
    assert best.stop and best.record.step == 4


def test_loss_names_default_to_lower_is_better_and_hf_eval_prefix_is_accepted():
    best = tracker(metric_for_best_model="eval_val_loss")
    best.observe(1, {"val_loss": 2.0})
    best.observe(2, {"val_loss": 1.0})
    assert best.record.metric == "val_loss" and not best.record.greater_is_better and best.saves_at(2)
    explicit = tracker(metric_for_best_model="val_loss", greater_is_better=True)
    explicit.observe(1, {"val_loss": 2.0})
    assert explicit.record.greater_is_better


def test_a_metric_the_default_metrics_lack_is_refused_before_any_process_starts():
    """A trial's --metric-for-best-model eval_loss on a built-in was refused at the first evaluation, after
    training to it; the default metrics' names are known at the start."""
    from shardtrain.workloads.base import Workload, check_metric_for_best_model, workload_class

    cfg = parse_cli(["--eval-every", "10", "--metric-for-best-model", "eval_loss"])
    builtin = workload_class(cfg)
    with pytest.raises(ConfigError) as e:
        check_metric_for_best_model(cfg, builtin)
    assert str(e.value) == (
        f"--metric-for-best-model (train.metric_for_best_model) eval_loss: not among {builtin.__name__}.metrics()' "
        "keys (accuracy, macro_f1, n_examples, f1_<class>, precision_<class>, recall_<class>) (they have no loss: "
        "return one from your metric_sums and metrics to choose by it)"
    )
    for fine in ("eval_macro_f1", "accuracy", "f1_negative", "eval_f1_2", "recall_negative", "precision_0"):
        check_metric_for_best_model(parse_cli(["--eval-every", "10", "--metric-for-best-model", fine]), builtin)

    class OwnMetrics(Workload):
        def metrics(self, sums):
            return {"loss": 0.0}

    check_metric_for_best_model(cfg, OwnMetrics)  # its keys are known at its first evaluation (below)


def test_a_class_f1_names_one_of_the_datas_classes_before_the_first_step():
    """f1_<class> can only be checked once the data has named the classes: in the run, before its first step."""
    from shardtrain.config.labels import ClassLabels
    from shardtrain.workloads.base import check_class_metric, workload_class

    cfg = parse_cli(["--eval-every", "10", "--metric-for-best-model", "f1_negtive"])
    builtin = object.__new__(workload_class(cfg))
    sentiment = ClassLabels(3, ("negative", "neutral", "positive"))
    with pytest.raises(ConfigError) as e:
        check_class_metric(cfg, builtin, sentiment)
    assert str(e.value) == (
        "--metric-for-best-model (train.metric_for_best_model) f1_negtive: no such class; the data's classes give "
        "f1_negative, f1_neutral, f1_positive"
    )
    check_class_metric(
        parse_cli(["--eval-every", "10", "--metric-for-best-model", "eval_f1_neutral"]), builtin, sentiment
    )
    check_class_metric(parse_cli(["--eval-every", "10", "--metric-for-best-model", "f1_1"]), builtin, ClassLabels(3))
    check_class_metric(
        parse_cli(["--eval-every", "10", "--metric-for-best-model", "recall_negative"]), builtin, sentiment
    )
    with pytest.raises(ConfigError, match="recall_negtive: no such class; the data's classes give recall_negative, "):
        check_class_metric(
            parse_cli(["--eval-every", "10", "--metric-for-best-model", "recall_negtive"]), builtin, sentiment
        )
    with pytest.raises(ConfigError, match="the data's classes give f1_0, f1_1$"):
        check_class_metric(
            parse_cli(["--eval-every", "10", "--metric-for-best-model", "f1_2"]), builtin, ClassLabels(2)
        )


def test_a_metric_the_workload_does_not_return_is_one_line_naming_the_flag():
    with pytest.raises(ConfigError) as e:
        tracker(metric_for_best_model="f1").observe(1, METRICS)
    assert str(e.value) == (
        "--metric-for-best-model (train.metric_for_best_model) f1: not among Task.metrics()' keys "
        "(accuracy, macro_f1, n_examples)"
    )
    with pytest.raises(
        ConfigError,
        match=r"^--early-stopping-patience \(train.early_stopping_patience\): Task "
        r"has no validation set",
    ):
        tracker(early_stopping_patience=1).observe(1, {})
    with pytest.raises(ConfigError, match=r"^--metric-for-best-model accuracy: Task.metrics\(\) returned 'high'"):
        tracker(metric_for_best_model="accuracy").observe(1, {"accuracy": "high"})


def test_a_resume_continues_the_record_and_another_metric_starts_over():
    first = tracker(early_stopping_patience=3)
    for step, acc in ((1, 0.6), (2, 0.5)):
        first.observe(step, {**METRICS, "accuracy": acc})
    saved = json.loads(json.dumps(first.checkpoint_state()))["best"]  # as trainer_state.json keeps it
    assert saved == {
        "metric": "accuracy",
        "greater_is_better": True,
        "step": 1,
        "value": 0.6,
        "evals_without_improvement": 1,
    }
    resumed = tracker(saved, early_stopping_patience=3)
    resumed.observe(3, {**METRICS, "accuracy": 0.5})
    resumed.observe(4, {**METRICS, "accuracy": 0.5})
    assert resumed.stop and resumed.record.step == 1  # 3 in a row across the resume
    other = tracker(saved, metric_for_best_model="macro_f1")
    other.observe(3, METRICS)
    assert other.record.metric == "macro_f1" and other.record.step == 3 and "start over" in other.console.warnings[0]
    off = tracker(saved)  # the flags dropped: the record is carried on, its checkpoint still kept
    off.observe(3, METRICS)
    assert off.checkpoint_state() == {"best": saved}
    assert stopped_early({"best": {**saved, "evals_without_improvement": 3}}, TrainConfig(early_stopping_patience=3))
    assert not stopped_early({"best": saved}, TrainConfig(early_stopping_patience=3))
    assert not stopped_early({"best": {**saved, "evals_without_improvement": 3}}, TrainConfig())


# ---- start-up ------------------------------------------------------------------------------------------------
def test_start_up_refuses_what_cannot_work_in_one_line():
    with pytest.raises(ConfigError) as e:
        parse_cli(["--early-stopping-patience", "2"])
    assert str(e.value) == (
        "--early-stopping-patience (train.early_stopping_patience) decides at the evaluations during training, "
        "and --eval-every (train.eval_every) is 0 (only at the end): set --eval-every N"
    )
    with pytest.raises(ConfigError, match=r"^--metric-for-best-model .* --eval-every \(train.eval_every\) is 0"):
        parse_cli(["--metric-for-best-model", "accuracy"])
    with pytest.raises(
        ConfigError,
        match=r"^--final-model-checkpoint \(checkpoint.final_model_checkpoint\) best: "
        r"no best checkpoint is kept",
    ):
        parse_cli(["--final-model-checkpoint", "best"])
    with pytest.raises(ConfigError, match=r"^--early-stopping-patience .* must be positive, got 0"):
        parse_cli(["--eval-every", "2", "--early-stopping-patience", "0"])
    with pytest.raises(ConfigError, match=r"^--early-stopping-threshold .* must be >= 0, got -0.1"):
        parse_cli(["--eval-every", "2", "--early-stopping-patience", "1", "--early-stopping-threshold=-0.1"])
    # It had no effect without a folder to write the final model to, and said nothing.
    with pytest.raises(ConfigError) as e:
        parse_cli(["--eval-every", "2", "--metric-for-best-model", "accuracy", "--final-model-checkpoint", "best"])
    assert str(e.value) == (
        "--final-model-checkpoint (checkpoint.final_model_checkpoint) best chooses what --final-model-dir gets, and "
        "none is set (SageMaker sets it): set --final-model-dir DIR, or after the run `shardtrain export RUN DIR "
        "--checkpoint best`"
    )
    cfg = parse_cli(["--eval-every", "2", "--metric-for-best-model", "accuracy", "--final-model-checkpoint", "best",
                     "--final-model-dir", "final"])  # fmt: skip
    assert cfg.checkpoint.final_model_checkpoint == "best"
    cfg = parse_cli(["--eval_steps", "2", "--early_stopping_patience", "3", "--greater_is_better", "false"])
    t = cfg.train
    assert (t.early_stopping_patience, t.greater_is_better, t.metric_for_best_model) == (3, False, None)
    assert cfg.checkpoint.final_model_checkpoint == "final"


# ---- checkpoints/best ----------------------------------------------------------------------------------------
class FakeStrategy:
    def __init__(self):
        self.dist = SimpleNamespace(is_rank0=True, rank=0, world_size=1)
        self.device = torch.device("cpu")

    def describe(self):
        return {"strategy": "fake"}

    def save(self, path):
        (path / "shard").write_text("data")


def state(step: int, best_step: int | None) -> dict:
    record = {
        "metric": "accuracy",
        "greater_is_better": True,
        "step": best_step,
        "value": 0.9,
        "evals_without_improvement": 0,
    }
    return {"step": step, "data": {}, "config": {}, **({"best": record} if best_step else {})}


def test_best_is_pointed_at_the_commit_and_keep_last_never_prunes_it(tmp_path):
    saves = Saves(FakeStrategy(), tmp_path, keep_last=1, background=False, console=Console())
    root = checkpoint.checkpoints_root(tmp_path)
    for step, best in ((1, None), (2, 2), (3, 2), (4, 2), (5, 5), (6, 5)):
        saves.save(step, state(step, best))
    assert [p.name for p in checkpoint.committed_steps(root)] == ["step-000005", "step-000006"]
    assert (root / "best").read_text() == "step-000005\n" and (root / "latest").read_text() == "step-000006\n"
    assert checkpoint.best_committed(root) == root / "step-000005"
    # Resolution for export / predict / the final model.
    assert checkpoint.find_checkpoint(tmp_path, "best", "export") == root / "step-000005"
    assert checkpoint.find_checkpoint(root, "best", "export") == root / "step-000005"
    assert checkpoint.find_checkpoint(tmp_path, "final", "export") == root / "step-000006"
    with pytest.raises(ConfigError, match=r"^export --checkpoint best: .*step-000006 is not a run's folder"):
        checkpoint.find_checkpoint(root / "step-000006", "best", "export")
    # A resume after a kill between the commit's `latest` and `best`: the restored record repairs the pointer.
    (root / "best").write_text("step-000002\n")
    assert checkpoint.best_committed(root) is None  # pruned: not committed any more
    BestCheckpoint(TrainConfig(), state(6, 5)["best"], "Task", Console()).repair_pointer(root, is_rank0=True)
    assert checkpoint.best_committed(root) == root / "step-000005"


def test_a_run_without_a_best_checkpoint_says_how_to_get_one(tmp_path):
    saves = Saves(FakeStrategy(), tmp_path, keep_last=2, background=False, console=Console())
    saves.save(1, state(1, None))
    with pytest.raises(ConfigError) as e:
        checkpoint.find_checkpoint(tmp_path, "best", "predict")
    assert str(e.value).startswith("predict --checkpoint best: ") and "--metric-for-best-model NAME" in str(e.value)


def test_the_report_and_wandb_mark_the_best_step_and_the_early_stop(tmp_path):
    from shardtrain.observability.report import write_report
    from shardtrain.observability.tracking import wandb_summary

    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "loss": 1.0 / i, "lr": 1e-3, "samples_per_sec": 9.0}) + "\n" for i in (1, 2, 3))
    )
    best = {
        "metric": "accuracy",
        "greater_is_better": True,
        "step": 1,
        "value": 0.75,
        "evals_without_improvement": 2,
        "checkpoint": "step-000001",
        "patience": 2,
        "threshold": 0.0,
    }
    summary = {"final_step": 3, "stopped_by": "early_stopping", "best": best, "eval": {"accuracy": 0.5}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    html = write_report(tmp_path).read_text()
    assert (
        "best checkpoint: step 1 (step-000001, checkpoints/best), accuracy 0.75 (greater is better); stopped "
        "early at step 3 after 2 evaluations without improvement (patience 2)"
    ) in html
    marks = wandb_summary(summary)
    assert (marks["best/step"], marks["best/value"], marks["best/metric"]) == (1, 0.75, "accuracy")
    assert marks["stopped_by"] == "early_stopping" and "best/step" not in wandb_summary({"best": None})
