"""fedpers: a federated simulator for differentially private personalization in the billboard model."""

__version__ = "0.1.0"
