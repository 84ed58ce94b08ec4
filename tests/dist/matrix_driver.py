"""Many training configurations in ONE process group: the strategy x workload x precision matrix at a
fraction of the cost of one launch each (imports, process-group start and DeepSpeed's op loading are paid once).

    torchrun --nproc_per_node=2 tests/dist/matrix_driver.py PLAN.json OUT_DIR

PLAN.json is a list of {"name", "args"} where args are exactly the command-line arguments of
`shardtrain/main.py`; each goes through the same parse_cli() -> train() as main.py. Rank 0 rewrites
OUT_DIR/results.json after every run, so a crash still leaves what ran before it. Optional per run:
  "weights": true      also write the initial weights and the weights in every saved checkpoint (safetensors)
  "expect_error": true a probe: an exception is recorded instead of ending the launch (keep probes last:
                       after a failure inside a collective the process group is not trusted any more)

    torchrun --nproc_per_node=2 tests/dist/matrix_driver.py --serve QUEUE_DIR OWNER_PID

The same, for many plans one after another (tests/launch.py's run_plan: one such launch per pytest worker
instead of one per test file). Each job is QUEUE_DIR/job-N.json, {"plan": PLAN.json, "out": OUT_DIR}; rank 0
writes QUEUE_DIR/done-N.json once every rank has finished it. A plan with a probe, or one that imported MLflow
(which the matrix test checks no run does), ends the launch after its job: later plans get a fresh process.
It also ends at QUEUE_DIR/stop, or when OWNER_PID (the pytest worker) is gone.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# As main.py's start-up (cli.run_command): the imports with rare collections, and the first run's loop restores
# them with the start-up heap frozen. Without it each full collection (a DDP re-wrap's, ZeRO-3's set-up's) walked
# the whole import heap here, 0.5 s each, and no user's process pays that.
from shardtrain.runtime.startup_gc import defer_collections  # noqa: E402

defer_collections()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from shardtrain.config.settings import parse_cli  # noqa: E402
from shardtrain.loop.train import Trainer  # noqa: E402
from shardtrain.runtime.distributed import barrier, teardown_and_exit  # noqa: E402

TORCH_LINEAR = torch.nn.functional.linear  # before any run: ZeRO-3's zero.Init swaps in DeepSpeed's


class BatchNormWatch:
    """A global forward hook: the dtypes BatchNorm weights and inputs have in training forwards. It runs before
    the modules' own hooks, so FSDP's unsharded (mixed-precision) parameters and ZeRO-3's gathered ones are what
    it sees. Other models built during a run (the banner's memory planner measures a throwaway copy) run one
    forward each; only modules that ran at least once per micro-step are the training model's."""

    def __init__(self):
        self.seen: dict[int, tuple[nn.Module, list]] = {}  # holding the module keeps its id() unique

    def __call__(self, module, args, output):
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            stats = self.seen.setdefault(id(module), (module, [0, set(), set()]))[1]
            stats[0] += 1
            stats[1].add(str(module.weight.dtype).replace("torch.", ""))
            stats[2].add(str(args[0].dtype).replace("torch.", ""))

    def report(self, forwards: int) -> dict:
        trained = [stats for _, stats in self.seen.values() if stats[0] >= forwards]
        self.seen.clear()
        return {
            "bn_calls": sum(s[0] for s in trained),
            "bn_modules": len(trained),
            "bn_weight_dtypes": sorted(set().union(*(s[1] for s in trained))),
            "bn_input_dtypes": sorted(set().union(*(s[2] for s in trained))),
        }


def main(plan_path: str, out_dir: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    out = Path(out_dir)
    results: dict[str, dict] = {}
    rank0 = None
    for entry in plan:
        name = entry["name"]
        cfg = parse_cli(entry["args"])
        watch = BatchNormWatch()
        handle = torch.nn.modules.module.register_module_forward_hook(watch)
        t0 = time.perf_counter()
        record: dict = {"args": entry["args"]}
        try:
            summary = Trainer(cfg).train()
            record["ok"] = True
        except Exception as e:  # noqa: BLE001 - only for probes; anything else re-raises below
            if not entry.get("expect_error"):
                raise
            record.update(
                ok=False,
                error=f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                traceback=traceback.format_exc()[-3000:],
            )
            summary = None
        finally:
            handle.remove()
        bn = watch.report(forwards=cfg.train.max_steps * cfg.train.grad_accum)
        record["seconds"] = time.perf_counter() - t0
        record["mlflow_imported"] = "mlflow" in sys.modules  # no run here reports to MLflow
        record["torch_linear_after"] = torch.nn.functional.linear is TORCH_LINEAR
        rank0 = dist.get_rank() == 0
        run_dir = Path(cfg.checkpoint.output_dir)
        if summary is not None and rank0:
            metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
            record.update(
                losses=[m["loss"] for m in metrics],
                grad_norms=[m["grad_norm"] for m in metrics],
                lrs=[m["lr"] for m in metrics],
                eval=summary["eval"],
                skipped_steps=summary["skipped_steps"],
                describe={
                    k: summary.get(k)
                    for k in (
                        "strategy",
                        "offload",
                        "sharding",
                        "recompute_blocks",
                        "precision",
                        "grad_accum",
                        "micro_batch_size",
                        "global_batch_size",
                        "params_frozen",
                        "params_trainable",
                        "param_dtype",
                        "reduce_dtype",
                        "units",
                        "norm_units",
                    )
                },
                **bn,
            )
            if entry.get("weights"):
                record["weights"] = write_weights(cfg, run_dir)
        results[name] = record
        if rank0:
            (out / "results.json").write_text(json.dumps(results, indent=1))
            print(
                f"[matrix] {name}: {'ok' if record['ok'] else record['error']} in {record['seconds']:.1f}s", flush=True
            )
        barrier()
    return 0


def write_weights(cfg, run_dir: Path) -> dict:
    """Rank 0: the initial weights (rebuilt exactly as train() builds them: same seed, same vocabulary) and the
    weights inside every committed checkpoint, read with the backends' own offline tools, as safetensors."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from shardtrain.builtin_workloads.networks import build_model

    vocab = None if cfg.model.pretrained else len(AutoTokenizer.from_pretrained(str(run_dir / "tokenizer")))
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cfg.data, vocab)
    files = {"frozen": model.freezable_parameter_names(cfg.model.freeze_layers), "steps": {}}
    save_file({k: v.detach().contiguous() for k, v in model.named_parameters()}, str(run_dir / "init.safetensors"))
    files["init"] = str(run_dir / "init.safetensors")
    for ckpt in sorted((run_dir / "checkpoints").glob("step-*")):
        sd = read_checkpoint_weights(ckpt)
        path = run_dir / f"weights-{ckpt.name}.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items() if k in dict(model.named_parameters())}, str(path))
        files["steps"][int(ckpt.name.split("-")[1])] = str(path)
    return files


def read_checkpoint_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    if (ckpt / "model_optim").is_dir():  # DDP / FSDP: torch.distributed.checkpoint
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        tmp = ckpt.parent / f".{ckpt.name}.pt"
        dcp_to_torch_save(str(ckpt / "model_optim"), str(tmp))
        sd = torch.load(tmp, weights_only=False)["model"]
        tmp.unlink()
        return {k: v.float() for k, v in sd.items() if isinstance(v, torch.Tensor)}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="engine")


def serve(queue: Path, owner: int) -> int:
    rank0 = os.environ.get("RANK", "0") == "0"
    job = 0
    while True:
        request, wait = queue / f"job-{job}.json", 0.05
        while not request.exists():
            if (queue / "stop").exists() or not _alive(owner):
                return 0
            time.sleep(wait)
            # A launch waits idle for most of the session (its worker is running other files' tests): polled at
            # 20 Hz, its three processes spent 1% of a core doing it. Backed off to 4 Hz, a new job waits <= 0.25 s.
            wait = min(2 * wait, 0.25)
        spec = json.loads(request.read_text())
        plan = json.loads(Path(spec["plan"]).read_text())
        mlflow_before = "mlflow" in sys.modules
        if rank0:
            print(f"[matrix] job {job}: {spec['plan']}", flush=True)
        main(spec["plan"], spec["out"])
        retire = any(e.get("expect_error") for e in plan) or ("mlflow" in sys.modules and not mlflow_before)
        barrier()
        if rank0:
            done = queue / f"done-{job}.json"
            done.with_suffix(".tmp").write_text(json.dumps({"retire": retire}))
            done.with_suffix(".tmp").rename(done)
        if retire:
            return 0
        job += 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        code = serve(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        code = main(sys.argv[1], sys.argv[2])
    teardown_and_exit(code)
