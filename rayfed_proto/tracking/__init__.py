"""Tracking: MLflow logging (driver only), plots and the terminal report."""

from rayfed_proto.tracking.mlflow_tracker import MlflowTracker, NullTracker, make_tracker, resolve_tracking_uri

__all__ = ["MlflowTracker", "NullTracker", "make_tracker", "resolve_tracking_uri"]
