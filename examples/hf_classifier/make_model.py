"""A Hugging Face sequence classifier as a team would have it after fine-tuning: a model folder written by
``save_pretrained`` (config.json + model.safetensors). Here a tiny BERT is created locally with random weights (no
hub download), so the example runs anywhere.

    python examples/hf_classifier/make_model.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, BertConfig


def main(out: Path) -> None:
    config = BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=3,
        id2label={0: "negative", 1: "neutral", 2: "positive"},
        label2id={"negative": 0, "neutral": 1, "positive": 2},
    )
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(str(out), safe_serialization=True)
    print(f"wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny_bert"))
