"""A minimal hand-written DeepSpeed ZeRO loop (deepspeed.initialize): shardtrain's ZeRO baseline.

    torchrun --nproc_per_node=2 benchmarks/handwritten_zero.py --config configs/multimodal_tiny.yaml \
        --ds ds_configs/zero2.json --data-dir DATA --output-dir OUT

The ZeRO section comes from the same --ds file; the rest of the DeepSpeed config is written out here, as a
user would, with the same client AdamW shardtrain hands the engine.
"""
import json
import sys

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench_common import StepLog, adamw, batches, data_and_model, finish, load_config, warmup_linear


def main(argv):
    cfg = load_config(argv)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loader, model = data_and_model(cfg, rank, world, dist.barrier)
    t = cfg.train
    ds_config = {"train_micro_batch_size_per_gpu": t.per_device_batch_size, "gradient_accumulation_steps": 1,
                 "gradient_clipping": t.max_grad_norm, "steps_per_print": 10 ** 9,
                 "zero_optimization": json.load(open(cfg.parallel.ds))["zero_optimization"],
                 "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
    opt = adamw(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_linear(cfg))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds_config)
    log = StepLog(cfg, rank)
    engine.train()
    data = batches(loader)
    for step in range(1, t.max_steps + 1):
        batch = next(data)
        logits = engine(batch["input_ids"], batch["attention_mask"], batch["pixel_values"])
        loss = F.cross_entropy(logits.float(), batch["labels"])
        engine.backward(loss)
        engine.step()  # clips, steps the optimizer and the schedule, zeroes the grads
        log.step(step, loss)
    log.close()
    finish()


if __name__ == "__main__":
    main(sys.argv[1:])
