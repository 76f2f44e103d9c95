"""Snapshots: storage (local folders and s3:// through fsspec), what a snapshot holds, retention and lineage.

- ``storage``: writing, listing, verifying and pruning snapshot folders; the manifest written last.
- ``manifest``: ``SnapshotManifest``, what a snapshot's manifest.json holds, and the one reader and writer of its JSON.
- ``contents``: the learner's part of a snapshot (weights, optimizer, scheduler, RNG, config) and its restore.
- ``lineage``: the Model Registry chain of snapshots, and rollback to one of them.
"""
