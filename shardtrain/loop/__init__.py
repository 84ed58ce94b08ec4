"""The training loop (train.py, top to bottom) and the per-step helpers it calls: non-finite
steps, OOM recovery, and what a resume with other settings says.
"""
