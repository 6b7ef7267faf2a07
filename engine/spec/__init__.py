"""Speculative decoding: drafters propose (ngram.py, later mtp.py, dflash.py), verify.py decides.

`base` holds the Drafter protocol and the mode registry (`available_modes`, `make_drafter`); `round` the
speculative round the generation loop runs instead of a plain step (`SpecRound`). Drafter modules load lazily.
"""
from .base import NO_DRAFTER, Drafter, available_modes, make_drafter, unavailable_reason
from .round import SpecRound, spec_round
from .verify import VerifyResult, verify

__all__ = ["NO_DRAFTER", "Drafter", "available_modes", "make_drafter", "unavailable_reason",
           "SpecRound", "spec_round", "VerifyResult", "verify"]
