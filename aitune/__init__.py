"""aitune: tune PyTorch models and pipelines for inference.

An independent, open-source implementation of the interface of NVIDIA AITune; not an NVIDIA product.
The PyTorch API lives in :mod:`aitune.torch` (``import aitune.torch as ait``).
"""

__version__ = "0.1.0"
