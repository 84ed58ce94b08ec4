"""The same training with the Hugging Face Trainer (a benchmark-only extra): the usual choice for Longformer.

    torchrun --nproc_per_node=2 benchmarks/hf_trainer_loop.py --config configs/longformer_tiny.yaml \
        --data-dir DATA --output-dir OUT [--strategy fsdp | --ds ds_configs/zero2.json]

The strategy the way Trainer users pick it, through TrainingArguments: DDP by launching under torchrun, FSDP by
`fsdp="full_shard auto_wrap"` with `fsdp_config` naming the blocks shardtrain's default policy shards (FSDP2),
DeepSpeed by `deepspeed=` the config (the ZeRO section of the same --ds file). The optimizer and schedule are
shardtrain's (Trainer's documented hooks: create_optimizer / create_scheduler; Trainer's own AdamW groups would
be the same two, but its AdamW is not foreach on CPU), the loss is the built-ins' (compute_loss). Step stamps come
from a TrainerCallback at on_step_end, on rank 0, into OUT/metrics.jsonl like every other contender.
"""

import json
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from bench_common import (
    adamw,
    block_classes,
    check_world,
    data_and_model,
    ds_config,
    finish,
    forward_loss,
    load_config,
    peer_strategy,
    warmup_linear,
)
from transformers import Trainer, TrainerCallback, TrainingArguments

from shardtrain.data import batch_to_device

EXPECTED = {"ddp": DistributedType.MULTI_CPU, "fsdp": DistributedType.FSDP, "deepspeed": DistributedType.DEEPSPEED}


class BuiltinTrainer(Trainer):
    def __init__(self, *a, shardtrain_cfg, shardtrain_sampler, **kw):
        self.shardtrain_cfg, self.shardtrain_sampler = shardtrain_cfg, shardtrain_sampler
        super().__init__(*a, **kw)

    def _get_train_sampler(self, train_dataset=None):
        # The epoch order every contender shares (bench_common.EpochOrder), not Trainer's own RandomSampler.
        return self.shardtrain_sampler

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = forward_loss(model, batch_to_device(inputs, self.args.device))
        return (loss, None) if return_outputs else loss

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = adamw(self.model if model is None else model, self.shardtrain_cfg)
        return self.optimizer

    def create_scheduler(self, num_training_steps, optimizer=None):
        if self.lr_scheduler is None:
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer or self.optimizer, warmup_linear(self.shardtrain_cfg)
            )
        return self.lr_scheduler


class StepStamps(TrainerCallback):
    """metrics.jsonl's {"step", "wall_time"} per optimizer step, on rank 0; refuses a run that is not the
    strategy asked for (Trainer falls back to plain data parallel without a word on some devices)."""

    def __init__(self, out: Path, kind: str):
        self.out, self.kind, self.file, self.trainer = out, kind, None, None

    def on_train_begin(self, args, state, control, **kw):
        got = self.trainer.accelerator.distributed_type
        if got != EXPECTED[self.kind]:
            raise RuntimeError(f"Trainer runs {got}, not {EXPECTED[self.kind]} as asked ({self.kind})")
        check_world(args.world_size)
        if state.is_world_process_zero:
            self.out.mkdir(parents=True, exist_ok=True)
            self.file = open(self.out / "metrics.jsonl", "w")

    def on_step_end(self, args, state, control, **kw):
        if self.file:
            self.file.write(json.dumps({"step": state.global_step, "wall_time": time.time()}) + "\n")

    def on_train_end(self, args, state, control, **kw):
        if self.file:
            self.file.close()


def training_args(cfg, model, out: Path) -> TrainingArguments:
    t, kind = cfg.train, peer_strategy(cfg)
    cpu = cfg.parallel.device == "cpu"
    extra = {}
    if kind == "fsdp":
        extra = {
            "fsdp": "full_shard auto_wrap",
            "fsdp_config": {
                "version": 2,
                "reshard_after_forward": True,
                "transformer_layer_cls_to_wrap": [c.__name__ for c in block_classes(model)],
            },
        }
    elif kind == "deepspeed":
        extra = {"deepspeed": ds_config(cfg)}
    return TrainingArguments(
        output_dir=str(out / "hf_trainer"),
        max_steps=t.max_steps,
        per_device_train_batch_size=t.per_device_batch_size,
        gradient_accumulation_steps=1,
        max_grad_norm=t.max_grad_norm,
        seed=t.seed,
        data_seed=t.seed,
        logging_steps=t.log_every,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=cpu,
        ddp_backend="gloo" if cpu else None,
        dataloader_num_workers=cfg.data.num_workers,
        dataloader_drop_last=True,
        dataloader_pin_memory=not cpu,
        remove_unused_columns=False,
        **extra,
    )


def main(argv):
    cfg = load_config(argv)
    out = Path(cfg.checkpoint.output_dir)
    torch.distributed.init_process_group("gloo")  # the tokenizer is trained on rank 0 behind a barrier
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    loader, model = data_and_model(cfg, rank, world, torch.distributed.barrier, shard=False)
    stamps = StepStamps(out, peer_strategy(cfg))
    trainer = BuiltinTrainer(
        model=model,
        args=training_args(cfg, model, out),
        train_dataset=loader.dataset,
        data_collator=loader.collate_fn,
        callbacks=[stamps],
        shardtrain_cfg=cfg,
        shardtrain_sampler=loader.sampler,
    )
    stamps.trainer = trainer
    trainer.train()
    finish()


if __name__ == "__main__":
    main(sys.argv[1:])
