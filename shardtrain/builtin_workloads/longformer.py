"""`workload: longformer`: HF's LongformerForSequenceClassification on long-document jsonl records."""

from __future__ import annotations

from shardtrain.builtin_workloads.jsonl_workload import JsonlWorkload


class LongformerWorkload(JsonlWorkload):
    def parts(self) -> dict[str, str]:
        return {"encoder": "hf.longformer", "classifier": "hf.classifier"}

    def block_classes(self) -> tuple:
        from transformers.models.longformer.modeling_longformer import LongformerLayer

        return (LongformerLayer,)

    def padded_tokens(self, lengths: list[int]) -> int:
        # collate rounds the longest text up to a multiple of the attention window (data/splits.py Collator)
        window = self.cfg.model.attention_window
        return len(lengths) * -(-max(lengths) // window) * window
