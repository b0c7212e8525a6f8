"""A Hugging Face text classifier as a team would have it: a BERT-class model folder written by ``save_pretrained``
(config.json + model.safetensors) with its ``tokenizer.json``. Here the WordPiece vocabulary is trained with the
``tokenizers`` library on ``corpus.txt`` beside this file and the model has random weights, so nothing is downloaded.

    python examples/hf_text_classifier/make_model.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForSequenceClassification, BertConfig

CORPUS = Path(__file__).with_name("corpus.txt")


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    # [PAD] first: id 0, the value the server pads token ids with.
    trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    tokenizer.train([str(CORPUS)], trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    config = BertConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        num_labels=3,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(str(out), safe_serialization=True)
    print(f"wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny_text_bert"))
