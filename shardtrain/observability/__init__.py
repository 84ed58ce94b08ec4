"""What a run shows and leaves behind: console, progress, banner, W&B, metrics.jsonl and
summary.json, and the reports, plots and run comparisons made from them.
"""
