"""Speculative decoding: proposers (n-gram lookup, a draft model), the lossless rejection sampler, and
the engine's glue (`Speculator`). See speculative/rejection.py for why the output is exact."""

from toolkit.speculative.config import METHODS, SpeculativeConfig, SpeculativeConfigError
from toolkit.speculative.ngram import NgramProposer
from toolkit.speculative.rejection import RejectionSampler, Verified

__all__ = ["METHODS", "NgramProposer", "RejectionSampler", "SpeculativeConfig", "SpeculativeConfigError", "Verified"]
