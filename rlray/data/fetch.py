"""Fetch the datasets rlray uses into a local folder (``make data``, ``rlray data``).

``fetch_dataset(name, dest)`` fills ``dest/<name>/`` from the first source that answers:

1. the mirror folder in env ``RLRAY_DATA_MIRROR`` (copies ``<mirror>/<name>/*``);
2. the Hugging Face hub (``openai/gsm8k`` config ``main``; ``Anthropic/hh-rlhf`` data_dir ``harmless-base``);
3. for gsm8k only, the raw files of github.com/openai/grade-school-math.

The environments' datasets ``retry-arith`` and ``guess-number`` are generated locally instead (``GENERATED``).

Each file lands atomically (written to a temporary folder, then ``os.replace``d into place), so a
folder that has all the expected files is complete, and a second call does nothing.

Command line: ``python -m rlray.data.fetch gsm8k hh-rlhf-harmless --dest data``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path

MIRROR_ENV = "RLRAY_DATA_MIRROR"
GSM8K_GITHUB_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/{split}.jsonl"
DOWNLOAD_TIMEOUT_S = 60.0
EXPECTED_FILES = {
    "gsm8k": ("train.jsonl", "test.jsonl"),
    "hh-rlhf-harmless": ("test.jsonl.gz",),
    "retry-arith": ("train.jsonl", "calibration.jsonl", "heldout.jsonl"),
    "guess-number": ("train.jsonl", "calibration.jsonl", "heldout.jsonl"),
}
# Datasets written here from a seeded generator (rlray.data.generate), not downloaded: name -> (generator
# kind, environment name in the configs, rows per split, seed). Their splits never share an item.
GENERATED = {
    "retry-arith": ("retry_arith", "retry_arith", {"train": 2000, "calibration": 200, "heldout": 200}, 0),
    "guess-number": ("guess", "guess", {"train": 400, "calibration": 61, "heldout": 54}, 0),
}


class FetchError(RuntimeError):
    """No source could provide a dataset. The message lists each source and why it failed."""


def fetch_dataset(name: str, dest: Path) -> Path:
    """Returns ``dest/<name>``, filled with the dataset's files from the first source that answers.

    Args:
        name: ``"gsm8k"`` (train.jsonl, test.jsonl), ``"hh-rlhf-harmless"`` (test.jsonl.gz), or a generated set
            (``GENERATED``: ``"retry-arith"``, ``"guess-number"``; train/calibration/heldout.jsonl, written anew on
            every call, byte-identical for the same generator).
        dest: the data folder (e.g. ``<repo>/data``); created when missing.

    Raises:
        ValueError: ``name`` is not a known dataset.
        FetchError: every source failed; the message has one line per source with its error.
    """
    if name not in EXPECTED_FILES:
        raise ValueError(f"unknown dataset '{name}'; known: {sorted(EXPECTED_FILES)}")
    target = Path(dest) / name
    if name not in GENERATED and _complete(name, target):  # generated sets are rewritten: cheap, and never stale
        return target
    target.mkdir(parents=True, exist_ok=True)
    failures = []
    for source, fill in _sources(name):
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
        try:
            fill(name, tmp)
            missing = [f for f in EXPECTED_FILES[name] if not (tmp / f).is_file()]
            if missing:
                raise FileNotFoundError(f"it did not provide {missing}")
            for item in sorted(tmp.iterdir()):
                os.replace(item, target / item.name)
            return target
        except Exception as err:  # any failure moves on to the next source; all are reported below
            failures.append(f"{source}: {type(err).__name__}: {err}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    raise FetchError(f"could not fetch '{name}' into {target}; every source failed:\n  - " + "\n  - ".join(failures))


def _complete(name: str, folder: Path) -> bool:
    """Returns whether ``folder`` holds every expected file of ``name``."""
    return all((folder / f).is_file() for f in EXPECTED_FILES[name])


def _sources(name: str) -> list[tuple[str, Callable[[str, Path], None]]]:
    """Returns the (label, filler) pairs to try for ``name``, in order."""
    if name in GENERATED:
        return [("seeded generator (rlray.data.generate)", _generate)]
    sources = [(f"mirror (env {MIRROR_ENV})", _from_mirror), ("Hugging Face hub", _from_hub)]
    if name == "gsm8k":
        sources.append(("GitHub openai/grade-school-math", _from_github))
    return sources


def _generate(name: str, out: Path) -> None:
    """Writes a generated dataset's three splits into ``out``; each row also gets ``prompt`` (a one-line description,
    the environment writes the real opening) and ``environment`` (the environment's name in the configs)."""
    from rlray.data.generate import build_rows

    kind, environment, sizes, seed = GENERATED[name]
    for split, n in sizes.items():
        rows = build_rows(kind, n, seed, split)
        for row in rows:
            row["prompt"] = (f"What is {row['a']} {row['op']} {row['b']}?" if kind == "retry_arith"
                             else f"Guess a number between {row['low']} and {row['high']}.")
            row["environment"] = environment
        _write_jsonl(rows, out / f"{split}.jsonl")


def _from_mirror(name: str, out: Path) -> None:
    """Copies ``$RLRAY_DATA_MIRROR/<name>/*`` into ``out``."""
    mirror = os.environ.get(MIRROR_ENV)
    if not mirror:
        raise FileNotFoundError(f"{MIRROR_ENV} is not set")
    folder = Path(mirror) / name
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    for item in folder.iterdir():
        if item.is_file():
            shutil.copy2(item, out / item.name)


def _from_hub(name: str, out: Path) -> None:
    """Writes the dataset's splits from the Hugging Face hub into ``out`` as JSON lines."""
    import datasets  # deferred: ~3 s, and `rlray data fetch` from the mirror (and every CLI command) does not need it

    if name == "gsm8k":
        splits = datasets.load_dataset("openai/gsm8k", "main")
        for split in ("train", "test"):
            _write_jsonl(splits[split], out / f"{split}.jsonl")
    else:
        test = datasets.load_dataset("Anthropic/hh-rlhf", data_dir="harmless-base", split="test")
        _write_jsonl(test, out / "test.jsonl.gz")


def _from_github(name: str, out: Path) -> None:
    """Downloads GSM8K's train/test JSON lines from the grade-school-math repository into ``out``."""
    for split in ("train", "test"):
        url = GSM8K_GITHUB_URL.format(split=split)
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            (out / f"{split}.jsonl").write_bytes(response.read())


def _write_jsonl(rows, path: Path) -> None:
    """Writes an iterable of dict rows as JSON lines (gzip when ``path`` ends in .gz)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Returns 0 after fetching each named dataset into ``--dest`` (command-line entry point)."""
    parser = argparse.ArgumentParser(prog="python -m rlray.data.fetch", description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="+", choices=sorted(EXPECTED_FILES), help="datasets to fetch")
    parser.add_argument("--dest", type=Path, default=Path("data"), help="data folder (default: ./data)")
    args = parser.parse_args(argv)
    for name in args.names:
        print(f"{name}: {fetch_dataset(name, args.dest)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
