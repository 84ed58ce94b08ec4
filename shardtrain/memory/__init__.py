"""Memory and compute accounting: the per-phase monitor, the planner behind `shardtrain plan`,
`--strategy auto`, and the FLOPs count behind MFU.
"""
