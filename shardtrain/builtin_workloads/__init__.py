"""The two built-in workloads, `multimodal` and `longformer`: their networks, their jsonl pipeline and what the
planner measures of them, written against the public Workload API as any user's workload is.

Nothing else in shardtrain imports this folder but the package root, which puts their settings (settings.py) in
the config's slot: `workload: multimodal` (or `model.name`) is looked up by name, as `--workload my_pkg.tasks:MyTask`
is (shardtrain/workloads/base.py workload_class).
"""
