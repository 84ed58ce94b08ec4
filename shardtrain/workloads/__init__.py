"""The public Workload API (base.py), `--peft lora` on any workload's model (adapters.py) and the pre-launch
check of a workload's data (check.py).

The loop, the strategies and the planner see a model only through base.py; the built-ins use it from
shardtrain/builtin_workloads/, where `workload: multimodal` is looked up by name.
"""
