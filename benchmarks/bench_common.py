"""What the hand-written and peer contenders (Accelerate, Lightning Fabric, HF Trainer) share with shardtrain: the
config, the data and the model, so that in benchmarks/overhead.py only the training loop differs.

Every contender (shardtrain included, through metrics.jsonl's `wall_time`) stamps the wall clock once per
optimizer step, at the same point: after the step's host sync. overhead.py derives steady-state samples/s
from those stamps alone, so loader time, logging and per-step bookkeeping all count, for everyone alike.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from shardtrain.builtin_workloads.networks import build_model  # noqa: E402
from shardtrain.config.settings import Config, parse_cli  # noqa: E402
from shardtrain.data import batch_to_device, build_datasets, build_tokenizer  # noqa: E402
from shardtrain.data.splits import make_collator  # noqa: E402
from shardtrain.strategies.optim import param_groups  # noqa: E402


def load_config(argv: list[str]) -> Config:
    """The same flags and YAML shardtrain reads (--config, --data-dir, --output-dir, ...)."""
    return parse_cli(argv)


class EpochOrder(torch.utils.data.Sampler[int]):
    """The whole epoch's sample order that shardtrain's loader strides its ranks' shares out of
    (data/loaders.py TrainStream: DistributedSampler's permutation taken with one replica, seed + epoch).

    A framework that shards a loader by samples (Fabric's DistributedSamplerWrapper) then gives each rank
    exactly shardtrain's samples; one that shards by batches (Accelerate, the HF Trainer) gives each optimizer
    step the same samples, split between the ranks in another way."""

    def __init__(self, dataset, seed: int):
        self.order = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True)

    def set_epoch(self, epoch: int) -> None:
        self.order.set_epoch(epoch)

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


def data_and_model(
    cfg: Config, rank: int, world: int, barrier, shard: bool = True
) -> tuple[DataLoader, torch.nn.Module]:
    """A plain DataLoader + DistributedSampler over shardtrain's dataset and collator (what users write),
    and the model built exactly as shardtrain builds it (same seed, so the same initial weights).
    shard=False: an unsharded loader over the whole epoch's order, for frameworks that shard it themselves
    (Accelerate, Fabric, the HF Trainer).

    Every contender sees shardtrain's data: the text tokenised ahead through the same datasets.map cache
    (collate only pads), and the samples of each optimizer step the ones shardtrain's loader takes. Without
    the first, the others tokenised in collate on the training process while shardtrain did not, which was
    its whole 12-31% lead on the Longformer cells."""
    out = Path(cfg.checkpoint.output_dir)
    tok = build_tokenizer(cfg, out, rank == 0, barrier)
    train_ds, _ = build_datasets(cfg, tok)
    d = cfg.data
    train_ds.tokenize(tok, d.max_length, d.preprocessing_num_workers, rank == 0, barrier)
    sampler = (
        DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg.train.seed, drop_last=True)
        if shard
        else EpochOrder(train_ds, cfg.train.seed)
    )
    w = cfg.data.num_workers
    loader = DataLoader(
        train_ds,
        batch_size=cfg.train.per_device_batch_size,
        sampler=sampler,
        drop_last=True,
        collate_fn=make_collator(cfg, tok),
        num_workers=w,
        persistent_workers=w > 0,
        pin_memory=cfg.data.pin_memory and torch.cuda.is_available(),
    )
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cfg.data, None if cfg.model.pretrained else len(tok))
    return loader, model


def adamw(model: torch.nn.Module, cfg: Config) -> torch.optim.AdamW:
    """AdamW with the usual two groups, no weight decay on biases and norm weights (the HF Trainer's rule),
    built by shardtrain's own param_groups: the same training math on both sides of the comparison. Not free: under
    ZeRO-2 the second group costs ~4% per step on the tiny model (DeepSpeed flattens and reduces each group on its
    own)."""
    groups = param_groups(model.named_parameters(), cfg.train.weight_decay, frozen_names=set())
    return torch.optim.AdamW(groups, lr=cfg.train.lr, foreach=True)


def warmup_linear(cfg: Config):
    t = cfg.train
    return lambda s: (
        (s + 1) / (t.warmup_steps + 1)
        if s < t.warmup_steps
        else max(0.0, 1 - (s - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
    )


def peer_strategy(cfg: Config) -> str:
    """ddp, fsdp or deepspeed: what the contender is asked for (--strategy, or --ds for ZeRO-2/3)."""
    return "deepspeed" if cfg.parallel.ds else cfg.parallel.strategy


def check_world(world: int) -> None:
    """A peer that quietly falls back to one process would be timed on half the work: refuse instead."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if world != launched:
        raise RuntimeError(f"the framework sees {world} process(es), the launcher started {launched}")


def forward_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The built-in workloads' step: the multimodal model reads pixels, Longformer does not; cross-entropy on
    fp32 logits, as shardtrain's loop computes it."""
    logits = model(batch["input_ids"], batch["attention_mask"], batch.get("pixel_values"))
    return F.cross_entropy(logits.float(), batch["labels"])


def ds_config(cfg: Config) -> dict:
    """The DeepSpeed config a user writes for this run: the ZeRO section from the same --ds file shardtrain
    reads, the client AdamW kept (no DeepSpeed Adam JIT build), clipping by the engine."""
    t = cfg.train
    return {
        "train_micro_batch_size_per_gpu": t.per_device_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": t.max_grad_norm,
        "steps_per_print": 10**9,
        "zero_optimization": json.loads(Path(cfg.parallel.ds).read_text())["zero_optimization"],
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }


def block_classes(model: torch.nn.Module) -> tuple[type, ...]:
    """The classes shardtrain's default FSDP policy shards one by one (transformer layers, ResNet blocks)."""
    return tuple(model.block_classes())


def batches(loader: DataLoader, device: torch.device | None = None):
    """Endless epochs, reshuffled each one, on `device`: the shared data pipeline hands over uint8 images,
    normalised on the device by the same function shardtrain's loop calls. `device`: the CPU when None."""
    device = device if device is not None else torch.device("cpu")
    epoch = 0
    while True:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for batch in loader:
            yield batch_to_device(batch, device)
        epoch += 1


class StepLog:
    """Rank 0 appends {"step", "loss", "wall_time"} per step to OUT/metrics.jsonl (the loss is read, which
    syncs, only every log_every steps: the way a careful hand-written loop logs)."""

    def __init__(self, cfg: Config, rank: int):
        self.rank, self.every = rank, cfg.train.log_every
        out = Path(cfg.checkpoint.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.file = open(out / "metrics.jsonl", "w") if rank == 0 else None

    def step(self, step: int, loss: torch.Tensor) -> None:
        if self.file is None:
            return
        record = {"step": step, "wall_time": time.time()}
        if step % self.every == 0:
            record["loss"] = loss.item()
            print(f"step {step} loss {record['loss']:.4f}", flush=True)
        self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.file:
            self.file.close()


def finish() -> None:
    """Same exit as shardtrain (distributed.teardown_and_exit): barrier, destroy, os._exit, no gloo abort."""
    from shardtrain.runtime.distributed import teardown_and_exit

    teardown_and_exit(0)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
