"""Pictures of trained models: reconstructions, the paper's Fig. 4 perturbations, routing maps, curves, confusion.

May import: capsnet.training and everything below it; never experiments or cli. matplotlib is imported lazily.
"""

from .figures import visualize

__all__ = ["visualize"]
