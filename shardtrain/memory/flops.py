"""Model FLOPs utilisation: counted training FLOPs per sample against the GPU's peak.

MFU = (FLOPs per sample x samples/s per GPU) / peak FLOPs of that GPU at the training dtype.
On CPU there is no meaningful peak, so no MFU is reported there.
"""

from __future__ import annotations

import torch

# Dense tensor-core peaks (no sparsity), FLOP/s, from the vendors' datasheets. fp32 is plain FP32; tf32 is what
# an fp32 run's matmuls reach with TF32 on (shardtrain's CUDA default, runtime/device_defaults.py; V100 has none).
PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
}


def peak_flops(device_name: str, precision: str) -> float | None:
    """Peak FLOP/s for a torch.cuda.get_device_name() string, or None when the GPU is not in the table."""
    for key, peaks in PEAK_FLOPS.items():  # "H100 PCIe" is listed before "H100": first match wins
        if all(part in device_name for part in key.split()):
            return peaks.get(precision)
    return None


def train_flops_per_sample(model_factory, batch, trainable_params: int) -> float:
    """Forward FLOPs of one sample counted once on a meta-device copy of the model (so CNN convolutions
    and attention are counted as they are, no weights materialised), x3 for forward + backward.
    Models whose forward needs real values (data-dependent shapes) fall back to 6 x params x tokens."""
    return counted_train_flops(model_factory, batch, trainable_params)[0]


def counted_train_flops(model_factory, batch: dict, trainable_params: int) -> tuple[float, str]:
    """train_flops_per_sample and how it was had: "counted" (FlopCounterMode on the meta device, x3) or
    "estimate: 6 x trainable params x tokens (...why the count failed)" (Longformer's forward reads values)."""
    from torch.utils.flop_counter import FlopCounterMode

    from shardtrain.data.batches import top_tensor

    why = "the count was 0"
    try:
        # A dict of tensors passed by name (the default Workload.forward); a batch of another shape (a nested dict,
        # a tuple) goes through the workload's own forward, which this count does not run: the fallback below.
        one = {k: v[:1] for k, v in batch.items()}
        model = model_factory(on_meta=True).eval()  # one sample: train-mode BatchNorm refuses a 1x1 map
        from shardtrain.workloads.base import model_inputs

        one = model_inputs(model, one)
        inputs = {
            k: torch.empty_like(v, device="meta") if v.is_floating_point() else torch.zeros_like(v, device="meta")
            for k, v in one.items()
        }
        if "attention_mask" in inputs:
            # No mask, the same FLOPs: HF's mask helpers read the mask's values (is it all ones?), which a
            # meta tensor does not have, and the count would fall back to the rough estimate below.
            inputs["attention_mask"] = None
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(**inputs)
        forward = counter.get_total_flops()
        if forward > 0:
            return 3.0 * forward, "counted: FlopCounterMode forward on the meta device x 3"
    except Exception as e:  # noqa: BLE001 - any meta-device failure means "count the simple way"
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
    input_ids = top_tensor(batch, "input_ids")
    tokens = input_ids[:1].numel() if input_ids is not None else 1
    return 6.0 * trainable_params * tokens, f"estimate: 6 x trainable params x tokens (meta-device count failed: {why})"


def mfu(flops_per_sample: float, samples_per_sec: float, world_size: int, peak: float | None) -> float | None:
    if not peak or flops_per_sample <= 0:
        return None
    return flops_per_sample * samples_per_sec / world_size / peak
