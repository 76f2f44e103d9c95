"""Watching a run: the metric registry (``metrics``: every key with its unit and meaning, the page's charts, the
gauges and console figures), MLflow tracking (``tracking``, the only module that imports mlflow), the monitor
(``monitor``: /health, /metrics, alerts, heartbeats, the driver's progress record) and the page (``page``, ``stored``)."""
