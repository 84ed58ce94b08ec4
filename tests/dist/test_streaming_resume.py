"""--streaming under 2 ranks: kill -9 mid-run, resume, the losses of an uninterrupted run. Real processes, gloo."""

from __future__ import annotations

import json

from launch import test_env, tiny_args, torchrun

# 45 examples split by node: 23 and 22, so the ranks' passes end at different steps and mid-batch; 8 per
# batch, the kill at step 5 falls in every rank's second pass, and the resume reads from the step-4 position.
STREAM = [
    "--streaming",
    "true",
    "--max-train-samples",
    "45",
    "--per-device-batch-size",
    "8",
    "--save-every",
    "2",
    "--max-steps",
    "6",
    "--eval-every",
    "0",
    "--max-eval-samples",
    "16",
]


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_streaming_kill9_resumes_exactly_under_two_ranks(mm_data, tmp_path):
    """Rank 1 is SIGKILLed mid-step 5; torchrun restarts the job, which resumes from step 4 by itself. The
    losses equal those of an uninterrupted run. Both runs tokenise the same validation split: the first
    through datasets.map, the restarts from its cache file."""
    cache = tmp_path / "hf_datasets_cache"  # cold for the first run
    ref = torchrun(tiny_args("multimodal", mm_data, tmp_path / "ref", *STREAM), env=test_env(HF_DATASETS_CACHE=cache))
    assert "streamed train" in ref.output and "validation: 16 token sequences tokenised and cached" in ref.output
    out = tmp_path / "killed"
    env = test_env(SHARDTRAIN_FAULT="step@5:1", SHARDTRAIN_FAULT_ONCE_DIR=tmp_path / "fired", HF_DATASETS_CACHE=cache)
    run = torchrun(
        tiny_args("multimodal", mm_data, out, *STREAM, "--resume", "auto"),
        env=env,
        extra_launcher_args=["--max-restarts", "2"],
        timeout=600,
    )
    assert run.output.count("[fault injection]") == 1, run.tail()
    resumed = [line.split(" at step ")[1] for line in run.output.splitlines() if line.startswith("resumed from ")]
    assert resumed == ["4"], run.tail()
    assert "validation: 16 token sequences loaded from the datasets cache" in run.output, run.tail()
    assert "tokenised and cached" not in run.output, run.tail()
    ref_losses, got = losses(tmp_path / "ref"), losses(out)
    state = json.loads((out / "checkpoints" / "step-000006" / "trainer_state.json").read_text())["data"]
    assert [r["epoch"] for r in state["ranks"]] == [2, 2] and state["world_size"] == 2, state
    assert len(got) == 6 and max(abs(a - b) for a, b in zip(ref_losses, got)) <= 1e-6, (ref_losses, got)
    print(f"\nstreaming: max |loss diff| {max(abs(a - b) for a, b in zip(ref_losses, got)):.2e}")
