"""`shardtrain report OUT` and `shardtrain compare OUT1 OUT2 ...`: HTML + PNG from run directories.

Both read only what a run wrote (metrics.jsonl, eval.jsonl, summary.json), so they work on runs from
another machine and on runs that were killed part-way.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from shardtrain.config.settings import ConfigError
from shardtrain.observability.comparable import WORKLOAD, differences, in_groups
from shardtrain.observability.metric_text import shown_as
from shardtrain.observability.runlog import MEMORY_PARTS, MIB, RunLog, headline_metrics, load_run, load_runs
from shardtrain.observability.step_profile import PARTS, profile_rows

COLUMNS = ("run", "strategy", "world", "memory/rank MiB", "samples/s", "final loss")


def columns(runs: list[RunLog]) -> tuple[str, ...]:
    """The fixed columns, then the runs' headline metrics (accuracy and macro-F1, or a workload's own)."""
    return (*COLUMNS, *(shown_as(k) for k in headline_metrics(runs)))


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_rows(runs: list[RunLog]) -> list[list[str]]:
    rows, shown = [], headline_metrics(runs)
    for run in runs:
        info = run.summary.get("run") or run.summary
        ev = run.eval_result
        rows.append(
            [
                run.label,
                run.strategy,
                str(info.get("world_size", "-")),
                _fmt(run.memory_per_rank_mib(), ".1f"),
                _fmt(run.samples_per_sec, ".1f"),
                _fmt(run.final_loss, ".4f"),
                *(_fmt(ev.get(k), ".4f") if isinstance(ev.get(k), (int, float)) else "-" for k in shown),
            ]
        )
    return rows


def text_table(header: tuple[str, ...], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w)  # noqa: E731
            for i, (c, w) in enumerate(zip(cells, widths))
        )

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def difference_warnings(runs: list[RunLog]) -> list[str]:
    """One line per setting in which the runs differ, and one per run whose settings are unknown."""
    diffs, unknown = differences(runs)
    return [d.line() for d in diffs] + [
        f"{label}: no summary.json or checkpoint records its settings: cannot check it against the others"
        for label in unknown
    ]


def verdict(runs: list[RunLog]) -> list[str]:
    """The answer to "which strategy should I use?" from what was measured: fastest, and leanest per rank.
    Only among runs of the same model and data: otherwise the numbers measure different work."""
    diffs, _ = differences(runs)
    apart = in_groups(diffs, WORKLOAD)
    if apart:
        return [
            f"no fastest or leanest run: these runs are not comparable, they differ in "
            f"{', '.join(d.setting.label for d in apart)} (compare runs of one model and data)"
        ]
    lines = []
    timed = [r for r in runs if r.samples_per_sec]
    if timed:
        best = max(timed, key=lambda r: r.samples_per_sec)
        lines.append(f"fastest: {best.label} ({best.strategy}, {best.samples_per_sec:.1f} samples/s)")
    sized = [r for r in runs if r.memory_per_rank_mib() is not None]
    if sized:
        lean = min(sized, key=lambda r: r.memory_per_rank_mib())
        lines.append(f"least memory per rank: {lean.label} ({lean.strategy}, {lean.memory_per_rank_mib():.1f} MiB)")
    losses = [r.final_loss for r in runs if r.final_loss is not None]
    if len(losses) > 1 and diffs:
        lines.append(f"final losses not compared: the runs differ in {', '.join(d.setting.label for d in diffs)}")
    elif len(losses) > 1:
        lines.append(
            f"final losses differ by at most {max(losses) - min(losses):.2e} "
            f"(use `shardtrain parity` for a step-by-step check)"
        )
    return lines


def best_lines(summary: dict) -> list[str]:
    """The best checkpoint (--metric-for-best-model) and an early stop, as the run's summary.json records them."""
    best = summary.get("best") or {}
    if best.get("step") is None:
        return []
    line = (
        f"best checkpoint: step {best['step']} ({best['checkpoint']}, checkpoints/best), "
        f"{best['metric']} {best['value']:.6g} ({'greater' if best['greater_is_better'] else 'lower'} is better)"
    )
    if summary.get("stopped_by") == "early_stopping":
        line += (
            f"; stopped early at step {summary.get('final_step')} after {best['evals_without_improvement']} "
            f"evaluations without improvement (patience {best.get('patience')})"
        )
    return [f"<p class='best'>{html.escape(line)}</p>"]


def _html_table(header, rows) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _value_html(key: str, value) -> str:
    """A setting as a reader wants it: rounded numbers with units the key names, nested mappings as
    sub-tables, lists as comma-separated values; never a Python repr."""
    if isinstance(value, dict):
        if not value:
            return "-"
        rows = "".join(
            f"<tr><th>{html.escape(_key_label(str(k), v))}</th><td>{_value_html(str(k), v)}</td></tr>"
            for k, v in value.items()
        )
        return f"<table class='sub'>{rows}</table>"
    if isinstance(value, (list, tuple)):
        return ", ".join(_value_html(key, v) for v in value) if value else "-"
    return html.escape(_scalar_text(key, value))


def _key_label(key: str, value) -> str:
    """A key whose unit its value now shows (`params_gib` shown as "9.7 MiB") loses the unit in its name: a label
    `params_gib` beside a value in MiB reads as a contradiction."""
    return key[: -len("_gib")] if key.endswith("_gib") and isinstance(value, float) else key


def _scalar_text(key: str, value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if key.endswith("_gib"):
            return f"{value:.2f} GiB" if value >= 1 else f"{value * 1024:.1f} MiB"
        if key.endswith("_seconds"):
            return f"{value:.2f} s"
        return f"{value:.4g}"
    return str(value)


def _settings_table(settings: dict) -> str:
    rows = "".join(
        f"<tr><th>{html.escape(_key_label(k, v))}</th><td>{_value_html(k, v)}</td></tr>" for k, v in settings.items()
    )
    return f"<table><tr><th>setting</th><th>value</th></tr>{rows}</table>"


STYLE = (
    "<style>body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse}"
    "td,th{border:1px solid #bbb;padding:4px 8px;text-align:right}th{background:#eee}"
    "table.sub{margin:0}table.sub th,table.sub td{border:none;padding:1px 6px;text-align:left;background:none}"
    "img{max-width:100%;border:1px solid #ddd;margin:6px 0}</style>"
)


def _figures(runs: list[RunLog], out: Path) -> list[Path]:
    from shardtrain.observability import plots

    return [
        plots.curves(runs, out / "curves.png"),
        plots.throughput(runs, out / "throughput.png"),
        plots.memory(runs, out / "memory.png"),
    ]


def _memory_rows(run: RunLog) -> list[list[str]]:
    return [[r, *(f"{run.memory[r].get(k, 0) / MIB:.2f}" for k in MEMORY_PARTS)] for r in sorted(run.memory, key=int)]


def run_workload(run: RunLog) -> tuple[str | None, dict]:
    """(workload target, its args) as the run recorded them in summary.json; (None, {}) if it did not finish."""
    from shardtrain.config.settings import recorded_workload_target

    cfg = run.summary.get("config") or {}
    return recorded_workload_target(cfg), (cfg.get("workload") or {}).get("workload_args") or {}


def check_workload(run: RunLog, workload: str | None, workload_args: dict | None) -> None:
    """--workload / --workload-args name what the user believes the run trained; the report reads the run, so a
    run of another workload (or other args) is one line, not a report under the wrong name."""
    from shardtrain.config.settings import BUILTIN_WORKLOADS

    target, args = run_workload(run)
    if target is None:
        return  # a run killed before its summary: nothing recorded to check against
    given = BUILTIN_WORKLOADS.get(workload, workload) if workload is not None else target
    if given != target or (workload_args is not None and workload_args != args):
        raise ConfigError(
            f"report: {run.path} trained {target} with args {json.dumps(args, default=str)}, not "
            f"{given}{'' if workload_args is None else ' with ' + json.dumps(workload_args)}: "
            f"the report reads the run; drop --workload or give another run"
        )


def write_report(
    run_dir: str | Path, out: str | Path | None = None, workload: str | None = None, workload_args: dict | None = None
) -> Path:
    run = load_run(run_dir)
    check_workload(run, workload, workload_args)
    out = Path(out) if out else run.path
    out.mkdir(parents=True, exist_ok=True)
    figures = _figures([run], out)
    info = run.summary.get("run") or {}
    # strategy_settings repeats the strategy's keys, which the run block holds at its top level.
    settings = {k: v for k, v in info.items() if k not in ("ranks", "strategy_settings")}
    parts = [f"<h1>shardtrain run: {html.escape(run.label)}</h1>", _html_table(columns([run]), table_rows([run]))]
    parts += best_lines(run.summary)
    if info.get("ranks"):
        parts += [
            "<h2>ranks</h2>",
            _html_table(
                ["rank", "host", "local rank", "device", "name"],
                [[r["rank"], r["host"], r["local_rank"], r["device"], r.get("device_name", "")] for r in info["ranks"]],
            ),
        ]
    target, args = run_workload(run)
    if target:
        # The workload's own metrics (perplexity, F1, ...), whatever metrics() returned, beside what it was.
        parts += [
            "<h2>workload</h2>",
            _settings_table({"target": target, "args": args, "validation metrics": run.eval_result}),
        ]
    parts += ["<h2>run</h2>", _settings_table(settings)]
    parts.append("<h2>memory per rank (MiB)</h2>")
    parts.append(
        _html_table(["rank", *MEMORY_PARTS], _memory_rows(run))
        if run.memory
        else "<p>no memory records in this run</p>"
    )
    profile = run.summary.get("profile") or {}
    if profile:  # --profile-steps
        a, b = profile["steps"]
        parts.append(f"<h2>where a step's time went (ms per step, steps {a}-{b})</h2>")
        parts.append(_html_table(["rank", "step", *PARTS, ""], profile_rows(profile)))
    parts += ["<h2>plots</h2>", *(f'<img src="{p.name}" alt="{p.stem}">' for p in figures)]
    path = out / "report.html"
    path.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>shardtrain report</title>{STYLE}"
        f"</head><body>{''.join(parts)}</body></html>\n"
    )
    return path


def write_compare(run_dirs: list[str], out: str | Path) -> tuple[Path, str]:
    runs = load_runs(run_dirs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = table_rows(runs)
    warned, verdict_lines = difference_warnings(runs), verdict(runs)
    text = "\n".join([text_table(columns(runs), rows), "", *(f"warning: {w}" for w in warned), *verdict_lines])
    figures = _figures(runs, out)
    parts = [
        "<h1>shardtrain: strategy comparison</h1>",
        _html_table(columns(runs), rows),
        *(["<ul>" + "".join(f"<li>warning: {html.escape(w)}</li>" for w in warned) + "</ul>"] if warned else []),
        "<ul>" + "".join(f"<li>{html.escape(v)}</li>" for v in verdict_lines) + "</ul>",
        *(f'<img src="{p.name}" alt="{p.stem}">' for p in figures),
    ]
    path = out / "compare.html"
    path.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>shardtrain compare</title>{STYLE}"
        f"</head><body>{''.join(parts)}</body></html>\n"
    )
    return path, text
