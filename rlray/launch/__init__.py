"""The driver side of a run: input checks before anything starts (``preflight``), placement of every role on the
cluster (``placement``), the Ray actors and their start-up (``actors``), and the whole job (``driver``)."""
