"""The public Workload API (base.py) and its pre-launch check (check.py), and the two built-ins that use it as
any user's workload would: `multimodal` and `longformer`.

The loop and the strategies import only base.py; `workload: multimodal` (or model.name, as configs written
before workloads said it) is looked up by name in shardtrain.config.settings.BUILTIN_WORKLOADS.
"""
