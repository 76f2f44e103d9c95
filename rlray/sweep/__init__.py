"""Sweeps: the sweep file's schema (``spec``), Ray Tune trials with ASHA (``tune``) and PBT on rlray's snapshots (``pbt``)."""
