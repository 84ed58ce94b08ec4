"""A GPT-2-architecture causal LM with tied input/output embeddings, trained on local text files.

    workload:
      target: causal_lm:CausalLM
      args: {text_dir: data/my_text, tokenizer: gpt2, model: gpt2, block_size: 128}

Perplexity comes from metric_sums / metrics: summed token NLL and token count add up exactly over batches and
ranks, so the perplexity is that of the whole validation set, not a mean of per-batch perplexities.
Activation checkpointing (--activation-checkpointing) applies to GPT2Block, from the model's _no_split_modules.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from shardtrain import Workload


class CausalLM(Workload):
    def __init__(
        self,
        cfg,
        text_dir: str,
        tokenizer: str,
        model: str | None = None,
        model_config: dict | None = None,
        block_size: int = 128,
    ):
        super().__init__(
            cfg, text_dir=text_dir, tokenizer=tokenizer, model=model, model_config=model_config, block_size=block_size
        )
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)

    def build_model(self):
        if self.args["model_config"] is not None:
            return AutoModelForCausalLM.from_config(AutoConfig.for_model(**self.args["model_config"]))
        if not self.loads_weights or torch.get_default_device().type == "meta":  # rank 0's weights come later
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.args["model"]))
        return AutoModelForCausalLM.from_pretrained(self.args["model"], dtype=torch.float32)

    def datasets(self):
        folder = Path(self.args["text_dir"])
        return self._blocks(folder / "train.txt"), self._blocks(folder / "validation.txt")

    def _blocks(self, path: Path) -> list[torch.Tensor]:
        """The file's tokens cut into block_size pieces (the tail that does not fill one is dropped)."""
        ids = self.tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]
        n = self.args["block_size"]
        return [torch.tensor(ids[i : i + n]) for i in range(0, len(ids) - n + 1, n)]

    def collate(self, samples):
        ids = torch.stack(samples)
        return {"input_ids": ids, "labels": ids}

    def forward(self, model, batch):
        return model(input_ids=batch["input_ids"]).logits  # the loss is ours: HF's would shift the same way

    def loss(self, logits, batch):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten())

    def metric_sums(self, logits, batch):
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), reduction="sum")
        return {"nll": nll, "tokens": torch.tensor(float(batch["labels"][:, 1:].numel()))}

    def metrics(self, sums):
        mean = (sums["nll"] / sums["tokens"].clamp(min=1)).item()
        return {"perplexity": math.exp(mean), "nll": mean, "n_tokens": int(sums["tokens"].item())}
