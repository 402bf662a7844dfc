"""Monarch linear layers: `monarch_linear` (y = x Mᵀ, M = P_out L P_mid R) and `monarch_project`."""
from .api import monarch_linear, monarch_project
from .reference import monarch_bmm, monarch_dense_reference, monarch_linear_reference, monarch_project_reference

__all__ = ["monarch_linear", "monarch_project", "monarch_linear_reference", "monarch_dense_reference",
           "monarch_project_reference", "monarch_bmm"]
