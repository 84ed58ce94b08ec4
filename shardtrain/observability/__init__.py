"""What a run shows and leaves behind: console, progress, banner, the loggers (W&B, TensorBoard, MLflow),
metrics.jsonl and summary.json, and the reports, plots and run comparisons made from them.
"""
