"""Logits processing both services share: top-k / top-p as per-row logit thresholds."""

from specdec.sampling.processing import logit_thresholds, sorted_thresholds

__all__ = ["logit_thresholds", "sorted_thresholds"]
