"""Building blocks several algorithms share: the low-rank regression baselines, population metrics and
the baselines that ride a private run's passes."""
