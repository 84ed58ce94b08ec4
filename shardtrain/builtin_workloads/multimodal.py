"""`workload: multimodal`: RoBERTa text encoder + torchvision CNN + fusion head, on text+image jsonl records."""

from __future__ import annotations

from shardtrain.builtin_workloads.jsonl_workload import JsonlWorkload


class MultimodalWorkload(JsonlWorkload):
    def parts(self) -> dict[str, str]:
        return {"text": "text", "image": "image", "fusion": "head"}

    def block_classes(self) -> tuple:
        # Imported here: the class is imported by processes that never build it (jsonl_workload.py says why).
        from torchvision.models.densenet import _DenseBlock
        from torchvision.models.resnet import BasicBlock, Bottleneck
        from transformers.models.roberta.modeling_roberta import RobertaLayer

        from shardtrain.builtin_workloads.networks.multimodal import IMAGE_ARCHS

        blocks = {"BasicBlock": BasicBlock, "Bottleneck": Bottleneck}
        m = self.cfg.model
        _, defaults = IMAGE_ARCHS[m.image_model]
        if "block_config" in defaults:  # DenseNet
            image_block = _DenseBlock
        else:
            block = m.image_config.get("block", defaults["block"])
            image_block = blocks.get(block, block) if isinstance(block, str) else block
        return (RobertaLayer, image_block)
