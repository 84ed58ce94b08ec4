"""`shardtrain parity`: the same seed, data and steps under several strategies, compared step by step.

    shardtrain parity --config configs/multimodal_tiny.yaml --strategies ddp,fsdp,zero2,zero3 --steps 10 --nproc 2
    shardtrain parity --workload tasks:MyTask --workload-args '{"width": 8}' --steps 5   # a user's workload
    shardtrain parity --runs runs/ddp,runs/fsdp        # runs that already finished: nothing is trained

Each strategy is one real `torchrun shardtrain/main.py` run, so what is compared is what users run.
With --runs, the runs' own metrics.jsonl are compared, after checking that they trained the same model on the
same data with the same seed and batch geometry (shardtrain/observability/comparable.py). The first strategy (or run) is
the reference. A step diverges when |loss - reference| / |reference| exceeds
--tolerance; the gradient norm is checked too (--grad-norm-tolerance), because Adam hides a wrong
gradient scale (an averaging or accumulation factor) from the loss. Both default to the row of TOLERANCES for
the runs' precision and device (docs/strategies.md, "Parity tolerances"). Exit 0: parity; 1: divergence;
3: a run failed (its log is kept).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from shardtrain.config.settings import ConfigError, add_workload_flags, command_config

REPO = Path(__file__).resolve().parents[2]
MAIN = REPO / "shardtrain" / "main.py"

# Strategy names -> the flags that select them. Paths are the repository's own configs.
STRATEGIES = {
    "ddp": ["--strategy", "ddp"],
    "fsdp": ["--strategy", "fsdp"],
    "fsdp_shard_grad_op": ["--strategy", "fsdp", "--fsdp-policy", str(REPO / "fsdp_policies/shard_grad_op.yaml")],
    "fsdp_offload": ["--strategy", "fsdp", "--fsdp-policy", str(REPO / "fsdp_policies/offload.yaml")],
    "zero2": ["--ds", str(REPO / "ds_configs/zero2.json")],
    "zero2_offload": ["--ds", str(REPO / "ds_configs/zero2_offload.json")],
    "zero3": ["--ds", str(REPO / "ds_configs/zero3.json")],
    "zero3_offload": ["--ds", str(REPO / "ds_configs/zero3_offload.json")],
}


# (precision, device) -> (loss, grad norm) relative tolerance. fp32 on CPU is measured: the strategies sum in
# other orders (all-reduce against reduce-scatter) and stay within 1e-4 / 1e-3 over 10 steps (tests/dist). On
# CUDA, TF32 matmuls (a 10-bit mantissa, on by default: --deterministic) and nondeterministic kernels and NCCL
# reductions add noise of their own; 16-bit runs round every activation, and FSDP's 16-bit all-gathers round
# the weights where DDP's autocast casts the same fp32 weights: bf16's unit roundoff is 3.9e-3, fp16's 4.9e-4.
# Rows other than fp32/cpu are sized from those formats, not yet measured on a GPU: the GPU suite's first run
# is to replace them.
TOLERANCES = {
    ("fp32", "cpu"): (1e-4, 1e-3),
    ("fp32", "cuda"): (2e-3, 2e-2),
    ("fp32", "cuda-deterministic"): (3e-4, 3e-3),
    ("bf16", "cpu"): (2e-2, 5e-2),
    ("bf16", "cuda"): (2e-2, 5e-2),
    ("fp16", "cpu"): (5e-3, 2e-2),
    ("fp16", "cuda"): (5e-3, 2e-2),
}


def run_settings(config: str | None, flags: list[str]) -> tuple[str, str]:
    """(precision, device) the runs train with: the flags passed through to every run over the YAML's."""
    from shardtrain.config.settings import load_yaml

    data = load_yaml(config) if config else {}
    precision = (data.get("train") or {}).get("precision", "fp32")
    device = (data.get("parallel") or {}).get("device", "auto")
    deterministic = bool((data.get("train") or {}).get("deterministic", False))
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--precision")
    parser.add_argument("--device")
    parser.add_argument("--deterministic")
    known, _ = parser.parse_known_args(flags)
    precision = known.precision or precision
    device = known.device or device
    if known.deterministic is not None:
        deterministic = known.deterministic.lower() in ("true", "1", "yes", "on")
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and precision == "fp32" and deterministic:
        device = "cuda-deterministic"
    return precision, device


def default_tolerances(precision: str, device: str) -> tuple[float, float]:
    if (precision, device) not in TOLERANCES:
        device = device.split("-")[0]
    return TOLERANCES.get((precision, device), TOLERANCES[("fp32", "cpu")])


def parse_strategies(spec: str) -> list[str]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise ConfigError(f"--strategies: unknown '{unknown[0]}' (choose from {', '.join(STRATEGIES)})")
    if len(names) < 2:
        raise ConfigError(f"--strategies: give at least two to compare, got '{spec}'")
    if len(set(names)) != len(names):
        raise ConfigError(f"--strategies: '{spec}' names a strategy twice")
    return names


def parse_args_for(items: list[str], names: list[str]) -> dict[str, list[str]]:
    """--args-for NAME='--flag value ...': extra flags for one strategy's run only."""
    extra: dict[str, list[str]] = {}
    for item in items:
        name, sep, flags = item.partition("=")
        if not sep or name not in names:
            raise ConfigError(f"--args-for {item!r}: expected NAME='--flag value' with NAME one of {', '.join(names)}")
        extra[name] = extra.get(name, []) + shlex.split(flags)
    return extra


def run_one(name: str, args: argparse.Namespace, common: list[str], extra: list[str], out: Path) -> Path | None:
    from shardtrain.runtime.distributed import free_port

    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    config = ["--config", str(Path(args.config).resolve())] if args.config else []
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={args.nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(MAIN),
        *config,
        *STRATEGIES[name],
        "--max-steps",
        str(args.steps),
        "--output-dir",
        str(run_dir),
        "--resume",
        "none",
        "--save-every",
        "0",
        "--save-final",
        "false",
        "--eval-every",
        "0",
        "--log-every",
        str(args.steps),
        "--report",
        "false",
        "--report-to",
        "none",
        "--predict-memory",
        "false",
        *common,
        *extra,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's choice; unset, the deepspeed path ran ~1.8x slower
    # The runs start where parity was started, as `train` would: a relative data_dir in the config, or a
    # relative --out, means the same folder to both. Python puts a script's folder, not the working directory, on
    # sys.path, so a --workload module there is put on it.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    log = run_dir / "parity.log"
    with open(log, "w") as f:
        f.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
        f.flush()
        code = subprocess.run(cmd, cwd=os.getcwd(), env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        print(f"parity: {name} failed (exit {code}); log: {log}\n{tail}", file=sys.stderr)
        return None
    return run_dir


def read_steps(run_dir: Path) -> dict[int, dict]:
    from shardtrain.observability.runlog import load_run

    return {r["step"]: r for r in load_run(run_dir).steps}


def rel_diff(value: float, reference: float) -> float:
    return abs(value - reference) / max(abs(reference), 1e-12)


def compare(results: dict[str, dict[int, dict]], tolerance: float, grad_tolerance: float) -> dict:
    """Per step: each strategy's loss and its relative differences from the first strategy's."""
    names = list(results)
    ref = results[names[0]]
    steps = sorted(set.intersection(*(set(r) for r in results.values())))
    rows, first_divergence = [], None
    for step in steps:
        row = {"step": step, "loss": {}, "loss_rel_diff": {}, "grad_norm_rel_diff": {}}
        for name in names:
            rec = results[name][step]
            row["loss"][name] = rec["loss"]
            if name == names[0]:
                continue
            dl = rel_diff(rec["loss"], ref[step]["loss"])
            dg = rel_diff(rec["grad_norm"], ref[step]["grad_norm"])
            row["loss_rel_diff"][name], row["grad_norm_rel_diff"][name] = dl, dg
            if first_divergence is None and (dl > tolerance or dg > grad_tolerance):
                first_divergence = {"step": step, "strategy": name, "loss_rel_diff": dl, "grad_norm_rel_diff": dg}
        rows.append(row)
    missing = {n: sorted(set(ref) ^ set(r)) for n, r in results.items() if set(r) != set(ref)}
    return {
        "reference": names[0],
        "tolerance": tolerance,
        "grad_norm_tolerance": grad_tolerance,
        "steps": rows,
        "first_divergence": first_divergence,
        "missing_steps": missing,
    }


def format_table(report: dict) -> str:
    names = list(report["steps"][0]["loss"]) if report["steps"] else []
    ref, others = names[:1], names[1:]
    head = (
        f"{'step':>4}  "
        + "  ".join(f"{n:>12}" for n in names)
        + "  "
        + "  ".join(f"{'Δloss ' + n:>18}  {'Δgnorm ' + n:>19}" for n in others)
    )
    lines = [
        f"relative differences from {''.join(ref)} (tolerance loss {report['tolerance']:g}, "
        f"grad norm {report['grad_norm_tolerance']:g})",
        head,
    ]
    for row in report["steps"]:
        lines.append(
            f"{row['step']:>4}  "
            + "  ".join(f"{row['loss'][n]:12.6f}" for n in names)
            + "  "
            + "  ".join(f"{row['loss_rel_diff'][n]:18.2e}  {row['grad_norm_rel_diff'][n]:19.2e}" for n in others)
        )
    return "\n".join(lines)


def check_comparable(runs) -> list[str]:
    """Refuse (one line) runs that cannot agree step by step; return one note per setting that differs
    without making the comparison meaningless (e.g. the learning rate, as --args-for can set it)."""
    from shardtrain.observability.comparable import TRAJECTORY, WORKLOAD, differences, in_groups

    diffs, unknown = differences(runs)
    if unknown:
        raise ConfigError(
            f"--runs: {unknown[0]} has no summary.json or checkpoint recording its settings: "
            f"cannot tell whether it is comparable"
        )
    refused = in_groups(diffs, WORKLOAD + TRAJECTORY)
    if refused:
        more = f" (and {len(refused) - 1} more difference(s))" if len(refused) > 1 else ""
        raise ConfigError(f"--runs: not comparable step by step: {refused[0].line()}{more}")
    return [d.line() for d in diffs]


def compare_runs(run_dirs: list[str]) -> tuple[dict[str, dict[int, dict]], list[str]]:
    """--runs A,B,...: each run's steps by its label, and notes on the settings that differ."""
    from shardtrain.observability.runlog import load_runs

    if len(run_dirs) < 2:
        raise ConfigError(f"--runs: give at least two run folders to compare, got {','.join(run_dirs) or 'none'}")
    if len({Path(d).resolve() for d in run_dirs}) != len(run_dirs):
        raise ConfigError(f"--runs: '{','.join(run_dirs)}' names a run twice")
    runs = load_runs(run_dirs)
    empty = [r.label for r in runs if not r.steps]
    if empty:
        raise ConfigError(f"--runs: {empty[0]} has no steps in metrics.jsonl: nothing to compare")
    notes = check_comparable(runs)
    return {r.label: {rec["step"]: rec for rec in r.steps} for r in runs}, notes


def conclude(results: dict[str, dict[int, dict]], args: argparse.Namespace, out: Path | None) -> int:
    """The table, parity.json (in `out`, if any) and the verdict; the exit code."""
    report = compare(results, args.tolerance, args.grad_norm_tolerance)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "parity.json").write_text(json.dumps(report, indent=2))
    where = f"; runs in {out}" if out is not None and not args.runs else ""
    print(format_table(report))
    div = report["first_divergence"]
    every = set().union(*(set(steps) for steps in results.values()))
    lacking = {name: sorted(every - set(steps)) for name, steps in results.items() if every - set(steps)}
    if lacking:
        said = "; ".join(f"{name} has no step {_listed(steps)}" for name, steps in lacking.items())
        # Finished runs of other lengths (a documented note-only difference) agree or not on the steps they share;
        # runs this command launched for the same steps did not all finish.
        if not (args.runs and report["steps"]):
            print(f"parity: runs logged different steps: {said}", file=sys.stderr)
            return 1
        print(f"parity: note: compared the {len(report['steps'])} steps every run logged ({said})")
    if div:
        print(
            f"parity: DIVERGED at step {div['step']}: {div['strategy']} vs {report['reference']} "
            f"(loss {div['loss_rel_diff']:.2e} relative, grad norm {div['grad_norm_rel_diff']:.2e}){where}"
        )
        drift = _late_drift(report)
        if drift:
            print(drift)
        return 1
    print(f"parity: OK, {', '.join(results)} agree over {len(report['steps'])} steps{where}")
    return 0


def _late_drift(report: dict, first: int = 5) -> str | None:
    """A note when the runs agreed to many digits over their first steps and parted later: the sign of
    summation-order noise that training amplifies, not of a wrong average, accumulation or sync, which differs
    from the first step. Measured on the tiny multimodal config (fp32, CPU, 60 steps): every strategy within 3e-6
    of DDP for 12 to 30 steps, then apart by up to 16% as the loss neared 0.01 (docs/strategies.md)."""
    early = report["steps"][:first]
    if len(early) < first or report["first_divergence"]["step"] <= early[-1]["step"]:
        return None
    loss = max(max(row["loss_rel_diff"].values(), default=0.0) for row in early)
    grad = max(max(row["grad_norm_rel_diff"].values(), default=0.0) for row in early)
    if loss > report["tolerance"] / 100 or grad > report["grad_norm_tolerance"] / 100:
        return None
    return (
        f"parity: note: the first {first} steps agreed within {loss:.1e} (loss) and {grad:.1e} (grad norm): the"
        f" strategies' summation orders differ, and training amplifies that noise (most on a small model near zero"
        f" loss), where a wrong average, accumulation or sync differs from step 1; compare the first steps"
        f" (--steps 10) or give longer runs a --tolerance"
    )


def _listed(steps: list[int], most: int = 5) -> str:
    shown = ", ".join(map(str, steps[:most]))
    return shown if len(steps) <= most else f"{shown}, ... ({len(steps)} in all)"


def runs_settings(spec: str) -> tuple[str, str]:
    """(precision, device) of the first finished run, from its summary.json (fp32 on CPU when it says nothing)."""
    first = next((d.strip() for d in spec.split(",") if d.strip()), None)
    try:
        summary = json.loads((Path(first) / "summary.json").read_text()) if first else {}
    except (OSError, ValueError):
        summary = {}
    precision = summary.get("precision") or "fp32"
    devices = {str(r.get("device", "cpu")).split(":")[0] for r in summary.get("ranks") or []} or {"cpu"}
    device = "cuda" if "cuda" in devices else "cpu"
    if device == "cuda" and precision == "fp32" and (summary.get("cuda_math") or {}).get("deterministic"):
        device = "cuda-deterministic"
    return precision, device


def _workload_flags(flags: list[str]) -> tuple[str | None, str | None]:
    """--workload and --workload-args among the flags passed through to every run (the last of each wins)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_workload_flags(parser)
    known, _ = parser.parse_known_args(flags)
    return known.workload, known.workload_args


def main(argv: list[str]) -> int:

    parser = argparse.ArgumentParser(
        prog="shardtrain parity",
        description=__doc__.split("\n\n")[0],
        epilog="Other flags (e.g. --data-dir DIR) are passed to every run.",
    )
    parser.add_argument(
        "--config", help="the training config every strategy runs (without --runs: it, or --workload, or both)"
    )
    parser.add_argument(
        "--runs",
        metavar="DIR,DIR[,...]",
        help="compare these finished runs' metrics.jsonl instead of training; the first is the reference",
    )
    parser.add_argument("--strategies", default=None, help="default: ddp,fsdp,zero2,zero3")
    parser.add_argument("--steps", type=int, default=None, help="default: 10")
    parser.add_argument("--nproc", type=int, default=None, help="default: 2")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="relative loss difference (default: by precision and device, 1e-4 for fp32 on CPU; docs/strategies.md)",
    )
    parser.add_argument(
        "--grad-norm-tolerance",
        type=float,
        default=None,
        help="relative gradient-norm difference (default: by precision and device, 1e-3 for fp32 on CPU)",
    )
    parser.add_argument(
        "--args-for",
        action="append",
        default=[],
        metavar="NAME='FLAGS'",
        help="extra flags for one strategy's run, e.g. --args-for fsdp='--lr 2e-3'",
    )
    parser.add_argument(
        "--out",
        help="keep the runs and parity.json here (default: a new temporary folder; "
        "with --runs, parity.json is written only when --out is given)",
    )
    parser.add_argument("--debug", action="store_true")
    args, common = parser.parse_known_args(argv)
    common = [a for a in common if a != "--debug"]
    if args.tolerance is None or args.grad_norm_tolerance is None:
        # --runs: the runs' own record is the reference's precision and device; otherwise what the runs will use.
        precision, device = runs_settings(args.runs) if args.runs is not None else run_settings(args.config, common)
        loss_tol, grad_tol = default_tolerances(precision, device)
        args.tolerance = loss_tol if args.tolerance is None else args.tolerance
        args.grad_norm_tolerance = grad_tol if args.grad_norm_tolerance is None else args.grad_norm_tolerance
        print(
            f"parity: tolerances for {precision} on {device}: loss {args.tolerance:g}, grad norm "
            f"{args.grad_norm_tolerance:g} (relative)"
        )

    if not (args.tolerance >= 0 and args.grad_norm_tolerance >= 0):
        raise ConfigError("--tolerance and --grad-norm-tolerance must be >= 0")
    if args.runs is not None:
        training = [
            flag
            for flag, value in (
                ("--config", args.config),
                ("--strategies", args.strategies),
                ("--steps", args.steps),
                ("--nproc", args.nproc),
                ("--args-for", args.args_for or None),
            )
            if value is not None
        ]
        training += common[:1]  # training flags for the runs to make
        if training:
            raise ConfigError(f"--runs compares finished runs and trains nothing: drop {training[0]}")
        results, notes = compare_runs([d.strip() for d in args.runs.split(",") if d.strip()])
        for note in notes:
            print(f"parity: note: {note}")
        return conclude(results, args, Path(args.out) if args.out else None)
    workload = _workload_flags(common)
    if args.config is None and workload[0] is None:
        raise ConfigError(
            "parity: give --config FILE or --workload my_pkg.tasks:MyTask (train each strategy), "
            "or --runs DIR,DIR (compare finished runs)"
        )
    names = parse_strategies(args.strategies or "ddp,fsdp,zero2,zero3")
    args.steps = 10 if args.steps is None else args.steps
    args.nproc = 2 if args.nproc is None else args.nproc
    if args.steps < 1 or args.nproc < 1:
        raise ConfigError(f"--steps and --nproc must be positive, got {args.steps} and {args.nproc}")
    from shardtrain.workloads.base import workload_class

    workload_class(command_config(args.config, *workload))  # imports, and names a Workload, before any run
    extra = parse_args_for(args.args_for, names)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="shardtrain-parity-"))
    results = {}
    for name in names:
        print(f"parity: running {name} ({args.steps} steps x {args.nproc} processes)", flush=True)
        run_dir = run_one(name, args, common, extra.get(name, []), out)
        if run_dir is None:
            return 3
        results[name] = read_steps(run_dir)
    return conclude(results, args, out)
