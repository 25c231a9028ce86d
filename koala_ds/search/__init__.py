"""Automatic schedule search: the BTT encoding, greedy seeds, the Dynamic Try-Test GA and an
exact CP-SAT solver (optional extra `exact`). No torch here."""
from .encoding import Encoding, EncodingError, OrderDecoder, RankChoices, decode, encode
from .ga import GAConfig, search
from .greedy import Policy, greedy_orders, greedy_seeds, policies
from .problem import (BACKWARD_CHOICES, PLACEMENT_CHOICES, SearchError, SearchProblem, backward_kinds,
                      default_placements, one_f_one_b_peak, placements_for, relative_gap, weight_copies)
from .results import LibraryRow, SearchResult, best_predefined, library_rows

__all__ = [
    "Encoding", "EncodingError", "OrderDecoder", "RankChoices", "decode", "encode",
    "GAConfig", "LibraryRow", "SearchResult", "best_predefined", "library_rows", "search",
    "Policy", "greedy_orders", "greedy_seeds", "policies",
    "BACKWARD_CHOICES", "PLACEMENT_CHOICES", "SearchError", "SearchProblem", "backward_kinds", "default_placements",
    "one_f_one_b_peak", "placements_for", "relative_gap", "weight_copies",
]
