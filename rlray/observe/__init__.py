"""Watching a run: MLflow tracking (``tracking``, the only module that imports mlflow) and the monitor (``monitor``:
/health, /metrics, alerts, heartbeats)."""
