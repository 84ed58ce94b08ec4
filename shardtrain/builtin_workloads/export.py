"""The built-ins' export layout (Workload.export_checkpoint / load_exported, shardtrain/checkpointing/export.py):

    longformer: the Hugging Face layout, AutoModelForSequenceClassification.from_pretrained(OUT)
    multimodal: model.safetensors + config.json (model.export_config()); load with load_export(OUT): RoBERTa + a
                torchvision CNN + a fusion head is no Hugging Face architecture
    both:       the run's tokenizer in OUT's root, truncating where training truncated; model_int8.pt with --int8

A LoRA run's adapters are always folded in: a built-in's format is the plain model's.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from shardtrain.checkpointing import store as checkpoint
from shardtrain.checkpointing.export import (
    EXPORT_META,
    INT8_FILE,
    label_maps,
    load_int8_weights,
    normal_mode,
    run_tokenizer,
    save_hf_quietly,
    save_int8,
    save_tokenizer,
)
from shardtrain.config.labels import run_config_dict
from shardtrain.config.settings import ConfigError, from_dict


def _vocab_size(model_sd: dict) -> int | None:
    for k, v in model_sd.items():
        if k.endswith("embeddings.word_embeddings.weight"):
            return v.shape[0]
    return None


def rebuild_from_checkpoint(ckpt_dir: Path):
    """(model with the checkpoint's weights, Config of the run)."""
    from shardtrain.builtin_workloads.networks import build_model
    from shardtrain.checkpointing.portable import read_portable

    state = checkpoint.read_trainer_state(ckpt_dir)
    cfg = from_dict(run_config_dict(state), source=f"{ckpt_dir}/{checkpoint.TRAINER_STATE}")
    weights = read_portable(ckpt_dir)["model"]
    base = state.get("base")
    if base is None:
        model = build_model(cfg.model, cfg.data, _vocab_size(weights), load_weights=False)
    else:  # a LoRA run's adapters only: the base rebuilt as training built it (seed, vocabulary, weights)
        from shardtrain.runtime.training_rng import aside

        vocab = None if cfg.model.pretrained else len(run_tokenizer(cfg, ckpt_dir.parent.parent))
        with aside(seed=cfg.train.seed):
            model = build_model(cfg.model, cfg.data, vocab, load_weights=True)
    if cfg.peft.peft:  # trained with adapters: their names, then folded in (a built-in exports the plain model)
        from shardtrain.workloads.adapters import base_fingerprint, check_same_base, frozen_base, with_lora

        model = with_lora(model, cfg.peft, cfg.model.name)
        check_same_base(base, base_fingerprint(model), f"export {ckpt_dir}", cfg.model.name)
        if base is not None:
            weights = {**{k: v for k, v in model.state_dict().items() if k in frozen_base(model)}, **weights}
    own = model.state_dict()
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    shapes = [k for k in set(own) & set(weights) if tuple(own[k].shape) != tuple(weights[k].shape)]
    if missing or unexpected or shapes:
        raise ConfigError(
            f"export {ckpt_dir}: weights do not fit the model in its config: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}, shape mismatches {sorted(shapes)[:4]}"
        )
    model.load_state_dict(weights, strict=True)
    if cfg.peft.peft:
        model = model.merge_and_unload()
    return model.eval(), cfg


def export_builtin(ckpt_dir: Path, out: Path, int8: bool) -> dict:
    """Writes the layout above into `out`; returns what shardtrain_export.json records."""
    model, cfg = rebuild_from_checkpoint(ckpt_dir)
    info = {
        "checkpoint": str(ckpt_dir),
        "model": cfg.model.name,
        "export_config": model.export_config(),
        **label_maps(cfg),
        "config": cfg.to_dict(),
    }  # the run's data settings: `predict` reads them
    hf = getattr(model, "hf", None)  # Longformer's Hugging Face model inside ours
    if hf is not None:
        # config.json + model.safetensors; the HF config has the run's id2label/label2id
        # (shardtrain/builtin_workloads/networks/archs.py)
        save_hf_quietly(hf, out)
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps({**model.export_config(), **label_maps(cfg)}, indent=1))
    normal_mode(out / "model.safetensors")
    save_tokenizer(run_tokenizer(cfg, ckpt_dir.parent.parent), cfg.data.max_length, out)
    info["bytes_fp32"] = (out / "model.safetensors").stat().st_size
    if int8:
        # The Hugging Face model inside ours, so that transformers + torch alone load the file.
        save_int8(hf if hf is not None else model, out / INT8_FILE)
        normal_mode(out / INT8_FILE)
        info["bytes_int8"] = (out / INT8_FILE).stat().st_size
        info["size_reduction"] = 1 - info["bytes_int8"] / info["bytes_fp32"]
    return info


def load_builtin_export(out: Path, int8: bool) -> nn.Module:
    """The architecture from the export's config (random init, no hub access), then its weights."""
    from safetensors.torch import load_file

    from shardtrain.builtin_workloads.networks import build_model_from_export

    meta = json.loads((out / EXPORT_META).read_text())
    model = build_model_from_export(meta["export_config"])
    hf = getattr(model, "hf", None)
    if int8:
        load_int8_weights(hf if hf is not None else model, out / INT8_FILE)
        return model.eval()
    sd = load_file(str(out / "model.safetensors"))
    if hf is not None:  # saved in the Hugging Face layout, whose names lack our wrapper's `hf.`
        sd = {f"hf.{k}": v for k, v in sd.items()}
    model.load_state_dict(sd, strict=True)
    return model.eval()
