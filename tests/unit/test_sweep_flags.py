"""A `wandb agent` passes each hyperparameter as `--key=value`, with the key as the sweep config spells it:
every flag must take that form, in its dashed and its underscore spelling."""

from __future__ import annotations

from typing import Literal, Optional, Union, get_args, get_origin

import pytest

from shardtrain.config.settings import FIELDS, RecomputeSetting, _coerce, _dashed_flag, build_arg_parser, flag_of


def _sample(typ) -> str:
    if get_origin(typ) is Union:
        return _sample(next(a for a in get_args(typ) if a is not type(None)))
    if get_origin(typ) is Literal:
        return str(get_args(typ)[-1])
    samples = {bool: "true", int: "3", float: "0.25", str: "some/value", dict: '{"layers": 2}', list: "3,5"}
    return {**samples, RecomputeSetting: "every-2"}[typ]


@pytest.mark.parametrize("spelling", ["dashed", "underscore"])
def test_every_flag_takes_the_sweep_agents_key_equals_value_form(spelling):
    parser = build_arg_parser()
    for name, (_section, _field, typ) in FIELDS.items():
        key = flag_of(name) if spelling == "dashed" else "--" + name
        value = _sample(typ)
        args, unknown = parser.parse_known_args([_dashed_flag(f"{key}={value}")])
        assert not unknown, f"{key}={value}: not taken ({unknown})"
        assert getattr(args, name) == value, f"{key}={value} parsed as {getattr(args, name)!r}"
        _coerce(name, value, typ, key)  # and the value converts to the field's type


def test_optional_bool_flags_alone_mean_true():
    args, _ = build_arg_parser().parse_known_args(["--wandb-log-model", "--wandb-system-metrics=false"])
    assert (args.wandb_log_model, args.wandb_system_metrics) == ("true", "false")
    assert _coerce("wandb_log_model", "true", Optional[bool], "--wandb-log-model") is True
