"""The built-in workloads, `multimodal` and `longformer`: users of the public Workload API like any other.

Nothing in the loop or the strategies imports this package; `workload: multimodal` (or model.name, as configs
written before workloads said it) is looked up by name in shardtrain.workloads.base.BUILTIN_WORKLOADS.
"""
