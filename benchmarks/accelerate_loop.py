"""The same training with Hugging Face Accelerate (a benchmark-only extra): what users would otherwise pick.

    torchrun --nproc_per_node=2 benchmarks/accelerate_loop.py --config configs/multimodal_tiny.yaml \
        --data-dir DATA --output-dir OUT

DDP (Accelerate's MULTI_CPU / MULTI_GPU path). The scheduler steps once per optimizer step, as shardtrain's
(Accelerate's default would step it once per process).
"""
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator

from bench_common import StepLog, adamw, batches, data_and_model, finish, load_config, warmup_linear


def main(argv):
    cfg = load_config(argv)
    accelerator = Accelerator(cpu=cfg.parallel.device == "cpu", step_scheduler_with_optimizer=False)
    rank, world = accelerator.process_index, accelerator.num_processes
    loader, model = data_and_model(cfg, rank, world, accelerator.wait_for_everyone, shard=False)
    opt = adamw(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_linear(cfg))
    # As users write it: Accelerate shards the loader across processes itself.
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    log = StepLog(cfg, rank)
    model.train()
    data = batches(loader)
    for step in range(1, cfg.train.max_steps + 1):
        batch = next(data)
        logits = model(batch["input_ids"], batch["attention_mask"], batch["pixel_values"])
        loss = F.cross_entropy(logits.float(), batch["labels"])
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        log.step(step, loss)
    log.close()
    finish()


if __name__ == "__main__":
    main(sys.argv[1:])
