"""A loss that is not finite on a fresh run's first step comes from the workload, not from
training, and names Workload.loss; one that turns non-finite later (or after a resume) is --nan-policy's."""

from __future__ import annotations

import math

import pytest

from shardtrain.config.settings import ConfigError
from shardtrain.loop.step_health import Agreement, BadStepPolicy


class Quiet:
    def __init__(self):
        self.warnings = []

    def warn(self, msg):
        self.warnings.append(msg)


def nan_step(bad_ranks=(1,)):
    return Agreement(loss_mean=math.nan, stop=False, bad_ranks=list(bad_ranks), oom_ranks=0)


def test_a_non_finite_loss_on_a_fresh_runs_first_step_names_workload_loss():
    policy = BadStepPolicy("skip", 5, Quiet(), True, first_step=1, loss_method="Tiny.loss")
    with pytest.raises(
        ConfigError,
        match=r"step 1: Tiny.loss returned a non-finite loss \(nan\) on rank 1 before any "
        r"update, so no learning rate or --nan-policy is the cause",
    ):
        policy.update(1, applied=False, overflow=False, agreed=nan_step(), grad_norm=math.nan)


def test_a_non_finite_loss_later_or_after_resume_is_the_nan_policys():
    console = Quiet()
    later = BadStepPolicy("skip", 5, console, True, first_step=1, loss_method="Tiny.loss")
    later.update(1, applied=True, overflow=False, agreed=Agreement(1.0, False, [], 0), grad_norm=1.0)
    later.update(2, applied=False, overflow=False, agreed=nan_step(), grad_norm=math.nan)  # transient: skipped
    resumed = BadStepPolicy("skip", 5, console, True, first_step=None, loss_method="Tiny.loss")
    resumed.update(41, applied=False, overflow=False, agreed=nan_step(), grad_norm=math.nan)
    assert (later.skipped, resumed.skipped) == (1, 1) and len(console.warnings) == 2
    # A finite loss with non-finite gradients on step 1 is the gradients' business: the policy's, too.
    grads = BadStepPolicy("skip", 5, console, True, first_step=1, loss_method="Tiny.loss")
    grads.update(1, applied=False, overflow=False, agreed=Agreement(1.0, False, [], 0), grad_norm=math.inf)
    assert grads.skipped == 1
