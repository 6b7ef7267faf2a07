"""GGUF block layouts and the numpy reference dequantization (the specification of every quant kernel)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT


@dataclass
class QTensor:
    """A weight as stored in the file. shape = (rows, cols) = (out_features, in_features).

    data: uint8 (rows, bytes_per_row) raw blocks, memory-mapped (never copied); 1-D float tensors keep
    their float dtype with shape (n,).
    """

    name: str
    qtype: QT
    shape: tuple[int, ...]
    data: np.ndarray
