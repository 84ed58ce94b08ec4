"""The slot through which the workloads the package ships add their settings, names and rules to the config.

config/ is the bottom layer and names no model. The package root (shardtrain/__init__.py) fills this slot once, with
builtin_workloads/settings.py's, before any config is read: torchtitan's model packages register their train specs
the same way, and its JobConfig takes extra sections from outside. Until then, and for a framework that ships none,
the defaults below hold: no names, no extra settings, no rules.
"""

from __future__ import annotations

from typing import Any, Mapping

Config = Any  # settings.py's Config, whose module imports this one


class ShippedWorkloads:
    """What the config asks of the workloads the package ships by name."""

    # Section name -> a subclass of settings.py's section of that name, with the shipped workloads' own fields
    # (their YAML keys and flags); a section not named keeps the framework's fields alone.
    sections: Mapping[str, type] = {}
    # The names --workload and model.name take -> `module:Class`; strings, so that naming one imports nothing.
    targets: Mapping[str, str] = {}
    # The jsonl records' two kinds, as make-data and check-data --kind spell them: each record with an image, and
    # without; and other names a user may mean by one of them (a workload's name for its records).
    image_records, text_records = "images", "text"
    record_kind_aliases: Mapping[str, str] = {}

    def named_by_workload(self, cfg: Config) -> Config:
        """cfg with whatever --workload NAME implies about the shipped workloads' own settings (resolution's first
        step, before any check reads them)."""
        return cfg

    def with_dependent_defaults(self, cfg: Config) -> Config:
        """cfg with the defaults of their settings that depend on others (resolution's last step)."""
        return cfg

    def check(self, cfg: Config) -> None:
        """Raise a ConfigError naming the flag or key for a combination of their settings that cannot work."""

    def reads_images(self, cfg: Config) -> bool:
        """Whether the configured model reads an image per jsonl record."""
        return False

    def pad_multiple(self, cfg: Config) -> int | None:
        """Texts are padded to a multiple of this many tokens; None: no such rule."""
        return None

    def hub_names(self, cfg: Config) -> dict[str, str | None]:
        """Field -> the hub name (or folder) it gives, for what the run loads by name, besides the tokenizer."""
        return {}

    def without_download(self, cfg: Config, field: str) -> str:
        """`; or ...`: how to train with nothing downloaded when `field`'s hub name is not at hand; "" if no way."""
        return ""
