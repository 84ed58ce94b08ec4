"""Start-up without the garbage collector's repeated passes over the import heap.

Importing torch, transformers (which imports torchvision, torchao and torch._dynamo itself) and DeepSpeed builds
close to a million long-lived objects, and the cyclic collector walks the young ones again every 700 allocations
while it does: a fifth of every rank's import time. So start-up runs with collections made rare, and the training
loop gets the collector back with the start-up heap frozen (gc.freeze: never scanned again, as CPython's docs
advise for a long-lived process's import state). benchmarks/import_gc.py measures it (dev machine, 5 interleaved
rounds, paired medians, in benchmarks/results/import_gc.json): a rank's imports cost 4.54 s CPU with Python's
thresholds, 3.70 s with a young collection every 100k allocations, 3.45 s every 1M (the setting below; 0.25 s
saved per process over 100k, noise floor 0.20 s), for 8.5 MiB more peak memory (831 MiB against 823).

The heap is also frozen before the strategy builds the model (freeze_start_up): the model build's full
collection that DeepSpeed's ZeRO-3 set-up makes (its defragment() calls gc.collect()) then walks what the run
made, not the imports: on the tiny multimodal config it walked 756k objects in 0.58 to 0.67 s of CPU per rank
before, 256k in 0.14 to 0.17 s after (two launches of two ranks each, interleaved).

The thresholds are raised, not the collector disabled: a command that never reaches the loop (predict, export,
plan) keeps a bounded heap. The loop restores the user's thresholds before its first step, so that a cycle holding
CUDA tensors (an exception's traceback, OOM recovery's) is freed as promptly as it would be without shardtrain.
"""

from __future__ import annotations

import gc

# A young-generation collection every million net allocations instead of 700: about one during start-up.
STARTUP_THRESHOLDS = (1_000_000, 50, 1000)
_saved: tuple[int, int, int] | None = None


def defer_collections() -> None:
    """At the entry of a command (cli.run_command): collections rare until restore_collections()."""
    global _saved
    if _saved is None:
        _saved = gc.get_threshold()
        gc.set_threshold(*STARTUP_THRESHOLDS)


def freeze_start_up() -> None:
    """Before the strategy builds the model: the heap so far (the imports, the data) frozen, where start-up
    deferred collections (a user's own script keeps its heap as it is). A full collection from here on walks the
    run's own objects, not the imported ones."""
    if _saved is not None:
        gc.freeze()


def restore_collections(freeze: bool = True) -> None:
    """Before the training loop: the start-up heap frozen, the thresholds as they were. A no-op where
    defer_collections() never ran (shardtrain.fit from a user's script leaves their collector alone).
    `freeze=False` at the end of a command run in a process that goes on (cli.main called from Python)."""
    global _saved
    if _saved is not None:
        if freeze:
            gc.freeze()
        gc.set_threshold(*_saved)
        _saved = None
