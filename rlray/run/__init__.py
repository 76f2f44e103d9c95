"""One learner rank's run: the session around the steps (restore, step boundary, finish), the online and offline
steps, snapshots, guards and hooks. ``rlray.launch`` starts it on every rank of the Ray Train worker group."""
