"""The built-ins' settings, names and rules: what they add to the config, through config/shipped.py's slot.

Their fields keep the YAML keys and flags users know (`model.image_model`, `--attention-window`): they are
subclasses of the config's own sections, which the package root (shardtrain/__init__.py) puts in the slot before
any config is read. Imports nothing but config/, so that `shardtrain doctor` and config errors stay free of torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional, get_args, get_type_hints

from shardtrain.config.settings import (
    REPO,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    check_positive,
    flag_of,
    is_builtin_workload,
    key_of,
    replace_fields,
    section_class,
    setting,
    value_of,
    where,
)
from shardtrain.config.shipped import ShippedWorkloads

MULTIMODAL, LONGFORMER = "multimodal", "longformer"
# The text encoders the two are built on: the default (the first report's RoBERTa), and the Longformer checkpoint.
MULTIMODAL_TEXT_MODEL, LONGFORMER_TEXT_MODEL = "roberta-base", "allenai/longformer-base-4096"
# Both are RoBERTa-family encoders (shardtrain/builtin_workloads/networks/archs.py): their positions start after
# this padding id.
ROBERTA_PAD_TOKEN_ID = 1


@dataclass(frozen=True)
class BuiltinModelConfig(ModelConfig):
    name: Literal["multimodal", "longformer"] = setting(
        MULTIMODAL,
        "the built-in model: multimodal (text + image fusion) or longformer (long documents)",
        compared_as="model",
    )
    text_model: str = setting(
        MULTIMODAL_TEXT_MODEL, "the text encoder: a Hugging Face hub name or a local folder", compared_as="text model"
    )
    # With pretrained=false the architecture alone is used (random init): the tests' tiny models.
    pretrained: bool = setting(
        True,
        "load the text model's pretrained weights; false: its architecture, randomly initialised",
        compared_as="pretrained weights",
    )
    text_config: dict = setting(
        {},
        'overrides of the text model\'s Hugging Face config, as JSON, e.g. {"num_hidden_layers": 2}',
        compared_as="text model config",
    )
    image_model: Literal["resnet50", "resnet18", "densenet121"] = setting(
        "resnet50", "the image encoder (torchvision) of the multimodal model", "image model", MULTIMODAL
    )
    image_weights: Optional[str] = setting(
        None,
        "the image encoder's weights: a torchvision weights name (e.g. "
        "IMAGENET1K_V2) or a local .pth/.safetensors file; unset: random init",
        compared_as="image weights",
        read_by=MULTIMODAL,
    )
    image_config: dict = setting(
        {},
        'overrides of the torchvision constructor, as JSON, e.g. {"layers": [1,1,1,1]} or DenseNet\'s block_config',
        compared_as="image model config",
        read_by=MULTIMODAL,
    )
    fusion: Literal["concat", "gated"] = setting(
        "concat", "how the multimodal head combines text and image features", "fusion", MULTIMODAL
    )
    fusion_hidden: int = setting(512, "width of the fusion head's hidden layer (units)", "fusion width", MULTIMODAL)
    dropout: float = setting(
        0.1, "dropout probability of the text encoder and the fusion head (0..1)", compared_as="dropout"
    )
    attention_window: int = setting(
        512, "Longformer's sliding attention window (tokens)", "attention window", LONGFORMER
    )
    channels_last: bool = setting(False, "channels-last layout for the CNN's activations: faster convolutions on GPUs")
    attention: Literal["sdpa", "eager"] = setting(
        "sdpa", "the text encoder's attention kernel: PyTorch SDPA (flash / memory-efficient) or plain matmuls"
    )


@dataclass(frozen=True)
class BuiltinDataConfig(DataConfig):
    data_dir: str = setting(
        "data/multimodal",
        "folder of train.jsonl and validation.jsonl (or of a published layout, with --dataset-format)",
    )
    image_size: int = setting(224, "images are resized to this many pixels square", "image size", MULTIMODAL)


# Beyond this, Longformer has no position embeddings.
LONGFORMER_MAX_POSITIONS = 16384


class Builtins(ShippedWorkloads):
    sections = {"model": BuiltinModelConfig, "data": BuiltinDataConfig}
    targets = {
        MULTIMODAL: "shardtrain.builtin_workloads.multimodal:MultimodalWorkload",
        LONGFORMER: "shardtrain.builtin_workloads.longformer:LongformerWorkload",
    }
    image_records, text_records = MULTIMODAL, "longdoc"
    # `check-data --kind longformer` does what the user means.
    record_kind_aliases = {LONGFORMER: "longdoc"}

    def named_by_workload(self, cfg: Config) -> Config:
        """`--workload longformer`: the built-in reads the model section as model.name did, so model.name says it.
        A config file's own model.name that names the other built-in is a contradiction, not a default to replace:
        its model settings were written for that one."""
        named = cfg.workload.workload
        if named not in get_args(get_type_hints(BuiltinModelConfig)["name"]):
            return cfg
        from_file = cfg.origins.get("name")
        if from_file and from_file[1] == cfg.model.name != named:
            raise ConfigError(
                f"{where('workload')} is {named} but {where('name')} is {cfg.model.name}: two built-ins; drop "
                f"{key_of('name')} (the workload names the model), or the workload"
            )
        return replace_fields(cfg, name=named)

    def with_dependent_defaults(self, cfg: Config) -> Config:
        """A pretrained text model needs the tokenizer it was trained with; unset, it is the model's own."""
        if cfg.model.pretrained and cfg.data.tokenizer is None:
            return replace_fields(cfg, tokenizer=cfg.model.text_model)
        return cfg

    def check(self, cfg: Config) -> None:
        m, d = cfg.model, cfg.data
        check_positive(cfg, "attention_window", "fusion_hidden")
        if not 0 <= m.dropout <= 1:  # not `< 0 or > 1`: NaN is refused too
            raise ConfigError(f"{where('dropout')} is a probability, between 0 and 1: got {m.dropout}")
        # Longformer splits its window in half on each side (builtin_workloads/networks/archs.py checks a per-layer
        # text_config one).
        if m.name == LONGFORMER and "attention_window" not in m.text_config and m.attention_window % 2:
            raise ConfigError(f"{where('attention_window')}: {m.attention_window} must be an even number of tokens")
        if m.name == LONGFORMER and d.max_length > LONGFORMER_MAX_POSITIONS:
            raise ConfigError(
                f"{where('max_length')}={d.max_length} is beyond the {LONGFORMER_MAX_POSITIONS} positions Longformer "
                f"supports"
            )
        self._check_positions(cfg)
        if m.attention != "sdpa" and m.name == LONGFORMER:
            raise ConfigError(
                f"{where('attention')}={m.attention}: Longformer has its own sliding-window attention; "
                f"the setting applies to the multimodal model's RoBERTa only"
            )
        if d.image_cache is not None and m.name != MULTIMODAL:
            raise ConfigError(f"{where('image_cache')}: only the multimodal model reads images; drop it for {m.name}")
        if d.dataset_format is not None and m.name != MULTIMODAL:
            raise ConfigError(
                f"{flag_of('dataset_format')} {d.dataset_format} ({key_of('dataset_format')}): the layouts pair each "
                f"text with an image; train them with the multimodal model, not {m.name}"
            )
        self._check_read_by_the_model_trained(cfg)

    @staticmethod
    def _check_positions(cfg: Config) -> None:
        """A text model built from its config gets the positions --max-length needs
        (shardtrain/builtin_workloads/networks/archs.py), unless text_config sets them: then they were set on
        purpose, and too few is the user's to fix, not ours to raise."""
        text_config, max_length = cfg.model.text_config, cfg.data.max_length
        positions = text_config.get("max_position_embeddings")
        pad = text_config.get("pad_token_id", ROBERTA_PAD_TOKEN_ID)
        if isinstance(positions, int) and isinstance(pad, int) and positions < max_length + pad + 1:
            raise ConfigError(
                f"{where('text_config')}: max_position_embeddings {positions} holds {positions - pad - 1} tokens "
                f"(positions start after pad_token_id {pad}), fewer than {where('max_length')} {max_length}: "
                f"set it to {max_length + pad + 1} or more, or leave it out"
            )

    @staticmethod
    def _check_read_by_the_model_trained(cfg: Config) -> None:
        """`--fusion gated` on a Longformer run changed nothing, without a word. A user's workload may read any
        setting from self.cfg, so its runs are not checked."""
        if not is_builtin_workload(cfg):
            return
        for section in ("model", "data"):
            for f in dataclasses.fields(section_class(section)):
                owner = f.metadata.get("read_by")
                default = f.default_factory() if f.default is dataclasses.MISSING else f.default
                if owner and owner != cfg.model.name and value_of(cfg, f.name) != default:
                    raise ConfigError(
                        f"{where(f.name)} is a setting of the {owner} model, and this run trains {cfg.model.name}, "
                        f"which does not read it: drop it"
                    )

    @staticmethod
    def check_text_model(cfg: Config) -> None:
        """Before launch, for a run that builds the model: the default text model is the multimodal one's, which
        the Longformer cannot be built on (data-only commands such as check-data never read it)."""
        if cfg.model.name == LONGFORMER and cfg.model.text_model == MULTIMODAL_TEXT_MODEL:
            raise ConfigError(
                f"{where('text_model')} is {cfg.model.text_model} (the multimodal model's text encoder, and the "
                f"default): longformer needs a Longformer checkpoint: --text-model {LONGFORMER_TEXT_MODEL} "
                f"(configs/longformer_tiny.yaml has a tiny one that downloads nothing)"
            )

    def reads_images(self, cfg: Config) -> bool:
        return cfg.model.name == MULTIMODAL

    def pad_multiple(self, cfg: Config) -> int | None:
        """Longformer pads to its attention window inside forward otherwise, on every step."""
        return cfg.model.attention_window if cfg.model.name == LONGFORMER else None

    def hub_names(self, cfg: Config) -> dict[str, str | None]:
        return {"text_model": cfg.model.text_model if cfg.model.pretrained else None}

    def without_download(self, cfg: Config, field: str) -> str:
        """For a new user offline: the same architecture randomly initialised (and, with no --tokenizer, a tokenizer
        trained on the data), or the shipped tiny config."""
        if field not in ("text_model", "tokenizer") or getattr(cfg.model, "name", None) is None:
            return ""
        how = (
            "--pretrained false (the same architecture, randomly initialised"
            + (", with a tokenizer trained on your data" if field == "text_model" else "")
            + ")"
        )
        if field == "tokenizer":
            how = "drop --tokenizer with --pretrained false (a tokenizer trained on your data)"
        tiny = REPO / "configs" / f"{cfg.model.name}_tiny.yaml"
        shown = f"configs/{tiny.name}"
        return f"; or train without downloading: {how}" + (f", or --config {shown}" if tiny.is_file() else "")


BUILTINS = Builtins()
