"""The argument parser of the ``rlray`` command: every command with what it does and examples, overrides given one way
(``KEY=VALUE`` arguments), and errors as ``rlray <command>:`` lines that say what to type, never argparse's wording.

A command's function lives in ``rlray.cli``; the parser names it (``handler``, its path such as ``"judge check"``).
Conventions every command follows:

- ``CONFIG`` is the run's config file (the YAML given to ``rlray train``): a positional argument where the command needs
  one, ``--config CONFIG`` where it is optional (the commands that read a finished run: its tracking store, experiment,
  ``checkpoint.uri`` and S3 options).
- Overrides are dotted ``KEY=VALUE`` arguments after the positional ones, anywhere among the options; later ones win.
  ``--set KEY=VALUE`` is the older spelling of the same, still taken, with one note on stderr.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import textwrap

from rlray import __version__


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's formatter that keeps descriptions and epilogs as written and never breaks a line at a hyphen
    (``rlray serve-reward CONFIG`` stays whole in the command list)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

CONFIG_HELP = "the run's config file (YAML), as given to rlray train, e.g. configs/grpo_gsm8k_tiny.yaml"
OVERRIDES_HELP = "dotted config overrides, e.g. learner.lr=1e-5 (later ones win)"
_SET_NOTE = "rlray: --set KEY=VALUE is deprecated; give overrides as plain KEY=VALUE arguments, e.g. {example}"


class RlrayParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are ``rlray <command>:`` lines that say what to type, with an example.

    Attributes:
        example: one command line that this (sub)command takes, shown with each error ("" at the top level).
        handler: the command path its function is kept under in ``rlray.cli`` ("train", "judge check"; "" for a
            parser with subcommands).
    """

    example = ""
    handler = ""

    def parse_known_args(self, args=None, namespace=None):  # noqa: D102 (argparse's own signature)
        ns, extra = super().parse_known_args(args, namespace)
        if self._subparsers is not None:
            return ns, extra
        # A leaf command: KEY=VALUE after an option is an override too (argparse hands it back as unknown); --set
        # values join the overrides; anything else left is an error under this command's name.
        if hasattr(ns, "overrides"):
            ns.overrides = list(ns.overrides or [])
            ns.overrides += [x for x in extra if "=" in x and not x.startswith("-")]
            extra = [x for x in extra if not ("=" in x and not x.startswith("-"))]
            if getattr(ns, "set_overrides", None):
                print(_SET_NOTE.format(example=self.example), file=sys.stderr)
                ns.overrides += ns.set_overrides
                ns.set_overrides = []
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns, extra

    def error(self, message: str):  # noqa: D102 (argparse's hook; never returns)
        print(f"{self.prog}: {self.plain(message)}", file=sys.stderr)
        hint = f"for example: {self.example}; " if self.example else ""
        print(f"{self.prog}: {hint}more with {self.prog} --help", file=sys.stderr)
        sys.exit(2)

    def plain(self, message: str) -> str:
        """Returns argparse's error ``message`` said in rlray's words: what is missing or wrong and what to type."""
        if m := re.fullmatch(r"the following arguments are required: (.*)", message):
            names = m[1].split(", ")
            if names == ["COMMAND"]:
                return f"give a command: {', '.join(self._commands())}"
            return "missing " + ", ".join(self._describe(n) for n in names)
        if m := re.fullmatch(r"argument (\S+): invalid choice: '(.*)' \(choose from (.*)\)", message):
            choices = re.findall(r"'([^']*)'", m[3])
            what = "command" if m[1] == "COMMAND" else m[1]
            near = difflib.get_close_matches(m[2], choices, n=1)
            return (f"unknown {what} {m[2]!r}" + (f"; did you mean {near[0]!r}?" if near else "")
                    + f" ({what} is one of: {', '.join(choices)})")
        if m := re.fullmatch(r"argument (\S+): invalid (\w+) value: '(.*)'", message):
            kind = {"int": "a whole number", "float": "a number"}.get(m[2], f"a {m[2]}")
            return f"{m[1]} takes {kind}, not {m[3]!r}"
        if m := re.fullmatch(r"argument (\S+): expected (?:one|at least one) argument", message):
            return f"{self._describe(m[1])} needs a value after it"
        if m := re.fullmatch(r"argument (\S+): ignored explicit argument '(.*)'", message):
            return f"{m[1]} takes no value (drop '={m[2]}')"
        if m := re.fullmatch(r"ambiguous option: (\S+) could match (.*)", message):
            return f"{m[1]} could be any of {m[2]}; type the option in full"
        if m := re.fullmatch(r"unrecognized arguments: (.*)", message):
            return self._unknown(m[1].split(" "))
        return re.sub(r"^argument (\S+): ", r"\1: ", message)

    def _commands(self) -> list[str]:
        """Returns the names of this parser's subcommands."""
        return list(self._subparsers._group_actions[0].choices) if self._subparsers else []

    def _describe(self, name: str) -> str:
        """Returns ``name`` (an option string, metavar or dest) with its metavar and the first clause of its help."""
        for action in self._actions:
            if name in action.option_strings or name in (action.metavar, action.dest):
                shown = f"{action.option_strings[0]} {action.metavar or action.dest.upper()}" if action.option_strings else name
                about = re.split(r";|,? e\.g\.", action.help or "")[0].strip()
                if about.count("(") > about.count(")"):  # cut inside a parenthesis: drop its opened part
                    about = about[: about.rfind("(")].strip()
                about = re.sub(r"\s*\([^)]*\)", "", about) if len(about) > 50 else about
                return f"{shown} ({about})" if about and about != argparse.SUPPRESS else shown
        return name

    def _unknown(self, words: list[str]) -> str:
        """Returns what to do about arguments this command does not take."""
        options = {o for a in self._actions for o in a.option_strings}
        if "--config" in words and "--config" not in options:
            return "the config file is this command's first argument, without --config"
        flags = [w for w in words if w.startswith("-")]
        near = [difflib.get_close_matches(f, options, n=1) for f in flags]
        said = ", ".join(f"{f!r}" + (f" (did you mean {n[0]}?)" if n else "") for f, n in zip(flags, near, strict=True))
        if flags:
            return f"unknown option {said}"
        return f"unexpected {' '.join(words)!r}: overrides are KEY=VALUE (e.g. learner.lr=1e-5)"


def _fill(text: str) -> str:
    """Returns ``text`` wrapped at 100 columns, paragraph by paragraph (blank lines kept)."""
    return "\n\n".join(textwrap.fill(" ".join(p.split()), 100) for p in text.strip().split("\n\n"))


def _command(sub: argparse._SubParsersAction, name: str, summary: str, about: str, examples: list[str], doc: str,
             handler: str = "") -> RlrayParser:
    """Returns the parser of command ``name``: ``summary`` in its parent's list, ``about`` (what it does) atop its help,
    ``examples`` (full command lines, the first shown with its errors) and the docs page ``doc`` below it."""
    epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples) + f"\n\nmore: {doc}"
    p = sub.add_parser(name, help=summary, description=_fill(about), epilog=epilog,
                       formatter_class=HelpFormatter)
    p.example, p.handler = examples[0], handler
    if handler:
        p.set_defaults(handler=handler)
    return p


def _subcommands(p: RlrayParser, dest: str) -> argparse._SubParsersAction:
    """Returns the required subcommand group of ``p`` (shown as COMMAND, named in its errors as 'command')."""
    return p.add_subparsers(dest=dest, required=True, metavar="COMMAND", title="commands")


def _run_config(p: RlrayParser, optional: bool = False) -> None:
    """Adds the run's config file (positional, or ``--config`` when ``optional``) and the KEY=VALUE overrides."""
    if optional:
        p.add_argument("--config", metavar="CONFIG", help=f"{CONFIG_HELP}; its tracking store, experiment, "
                       "checkpoint.uri and S3 options are read (default: the built-in defaults)")
    else:
        p.add_argument("config", metavar="CONFIG", help=CONFIG_HELP)
    p.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help=OVERRIDES_HELP)
    p.add_argument("--set", dest="set_overrides", action="append", default=[], metavar="KEY=VALUE", help=argparse.SUPPRESS)


def _run_id(p: RlrayParser) -> None:
    """Adds the RUN_ID of a run kept in MLflow and the store it is read from."""
    p.add_argument("run", metavar="RUN_ID", help="MLflow run id (or runs:/RUN_ID), printed by rlray train")
    p.add_argument("--tracking-uri", help="MLflow store (default: --config's tracking.mlflow_uri, else "
                   "sqlite:///mlruns/mlflow.db)")


def build_parser() -> RlrayParser:
    """Returns the argument parser of the ``rlray`` command (each leaf names its function in ``rlray.cli``)."""
    p = RlrayParser(prog="rlray", description=_fill("rlray: Ray-native RL post-training for LLMs. One YAML config "
                    "(CONFIG) names the model, data, rewards and algorithm; KEY=VALUE arguments override its dotted keys."),
                    epilog="examples:\n  rlray train configs/grpo_gsm8k_tiny.yaml\n  rlray check configs/grpo_gsm8k_tiny.yaml"
                    " learner.lr=1e-5\n  rlray train --help\n\nmore: docs/index.md, docs/troubleshooting.md",
                    formatter_class=HelpFormatter)
    p.example = "rlray train configs/grpo_gsm8k_tiny.yaml"
    p.add_argument("--version", action="version", version=f"rlray {__version__}")
    sub = _subcommands(p, "command")

    t = _command(sub, "train", "run an experiment: rlray train CONFIG [KEY=VALUE ...] [--resume latest|URI]", """
        Runs the experiment CONFIG describes: checks every input first (as rlray check), starts Ray, the rollout
        engines and the learner, logs to MLflow, and prints the run id, the live page and the log folder. Exit
        status: 0 when the run finished (or spent run.max_wall_time_s), 1 when it failed or was stopped, 2 for a bad input found before it
        started.""", ["rlray train configs/grpo_gsm8k_tiny.yaml",
                      "rlray train configs/grpo_gsm8k_tiny.yaml learner.lr=1e-5 run.max_steps=20",
                      "rlray train configs/grpo_gsm8k_tiny.yaml --resume latest"], "docs/quickstart.md", "train")
    _run_config(t)
    t.add_argument("--resume", metavar="latest|URI",
                   help="'latest' (newest complete snapshot under checkpoint.uri) or a snapshot URI")
    t.add_argument("-v", "--verbose", action="store_true",
                   help="show every process's output and library logs here (default: start lines, one progress bar, "
                   "rlray's warnings and alerts; the full logs go to <run.output_dir>/logs/<run id>/)")

    k = _command(sub, "check", "check a config without launching: rlray check CONFIG [KEY=VALUE ...]", """
        Checks a config without launching anything: every input of the run (model, data, rewards, environments,
        storage), then shows each environment's first prompt with its tools, as the model sees it.""",
                 ["rlray check configs/grpo_gsm8k_tiny.yaml", "rlray check configs/envs/calculator_tiny.yaml env.default=calc"],
                 "docs/quickstart.md", "check")
    _run_config(k)

    w = _command(sub, "sweep", "Ray Tune sweep: rlray sweep CONFIG SWEEP [KEY=VALUE ...]", """
        Runs a Ray Tune sweep over CONFIG: SWEEP (a YAML file) gives the search space, the metric and the scheduler;
        each trial is a run in MLflow under one parent run. Overrides apply to CONFIG before the sweep's values.""",
                 ["rlray sweep configs/grpo_gsm8k_tiny.yaml configs/sweeps/grpo_lr_beta.yaml run.max_steps=4"],
                 "docs/distributed.md", "sweep")
    w.add_argument("config", metavar="CONFIG", help=CONFIG_HELP)
    w.add_argument("sweep", metavar="SWEEP", help="sweep file (space, metric, scheduler), e.g. configs/sweeps/grpo_lr_beta.yaml")
    w.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help=OVERRIDES_HELP)
    w.add_argument("--set", dest="set_overrides", action="append", default=[], help=argparse.SUPPRESS)

    e = _command(sub, "eval", "score a checkpoint on the eval set: rlray eval CONFIG --checkpoint PATH", """
        Scores a checkpoint on CONFIG's eval set (eval.*) and prints the metrics as JSON.""",
                 ["rlray eval configs/grpo_gsm8k_tiny.yaml --checkpoint tiny-random",
                  "rlray eval configs/grpo_gsm8k_tiny.yaml eval.num_problems=50 --checkpoint exported/grpo"],
                 "docs/quickstart.md", "eval")
    _run_config(e)
    e.add_argument("--checkpoint", required=True, metavar="PATH", help="snapshot folder/URI, HF folder or model alias")

    r = _command(sub, "serve-reward", "run the reward and judge Serve applications: rlray serve-reward CONFIG", """
        Runs the reward Serve application and the judges' (reward.judges) on the Ray cluster. On running
        applications of the same names it hot-swaps them to this config's reward.version.""",
                 ["rlray serve-reward configs/judge_gsm8k_smollm2.yaml --detach"], "docs/judges.md", "serve-reward")
    _run_config(r)
    r.add_argument("--detach", action="store_true", help="deploy or update, then exit (the app keeps running on the cluster)")

    j = _command(sub, "judge", "judges (reward.judges): rlray judge check CONFIG [KEY=VALUE ...] [--rows N]", """
        Commands about the LLM judges of reward.judges.""", ["rlray judge check configs/judge_gsm8k_smollm2.yaml --rows 8"],
                 "docs/judges.md")
    jc = _command(_subcommands(j, "judge_command"), "check", "answer N rows with the policy and judge the answers", """
        Before training: answers N training rows with the policy, judges the answers, and prints the agreement with
        the reward functions (accuracy, Cohen's kappa, confusion table), the score spread, parse failures and
        position bias.""", ["rlray judge check configs/judge_gsm8k_smollm2.yaml --rows 8",
                            "rlray judge check configs/judge_gsm8k_smollm2.yaml rollout.samples_per_prompt=4 --json"],
                  "docs/judges.md", "judge check")
    _run_config(jc)
    jc.add_argument("--rows", type=int, default=16, metavar="N", help="training rows to answer and judge (default 16)")
    jc.add_argument("--threshold", type=float, help="judge score read as 'yes' from (default: the middle of its scale)")
    jc.add_argument("--response-column", help="judge this column's response of each row instead of the policy's samples")
    jc.add_argument("--label-column", help="a column with a reference value per row (above 0 is 'yes') to agree with")
    jc.add_argument("--json", action="store_true", help="print the reports as JSON")

    b = _command(sub, "rollback", "prepare a resume from a snapshot: rlray rollback RUN_OR_URI --to STEP|vVERSION", """
        Prepares a resume from an earlier snapshot of a run: writes a resume config (the run's config with
        checkpoint.resume_from set) into --dest and prints it; then rlray train that config.""",
                 ["rlray rollback 1a2b3c4d5e6f --to 12 --config configs/grpo_gsm8k_tiny.yaml",
                  "rlray rollback outputs/run/snapshots --to v3 tracking.experiment=grpo-gsm8k"],
                 "docs/operations.md", "rollback")
    b.add_argument("ref", metavar="RUN_OR_URI", help="MLflow run id, a run's snapshot folder, or the storage root")
    b.add_argument("--to", required=True, metavar="STEP|vVERSION", help="a step (12) or a registered model version (v3)")
    b.add_argument("--dest", help="folder for the resume config (default rollback/<ref>-<to>)")
    _run_config(b, optional=True)

    x = _command(sub, "export", "write a run's policy as a plain Hugging Face folder: rlray export RUN_OR_SNAPSHOT --to DIR",
                 """
        Writes the policy of a snapshot as a plain Hugging Face folder: safetensors weights, config.json,
        generation_config.json, the tokenizer with the run's chat template. transformers loads it
        (AutoModelForCausalLM.from_pretrained(DIR)) and vLLM serves it (vllm serve DIR). A LoRA policy is merged
        into its base weights (float32), or kept as a peft adapter folder with --adapter.""",
                 ["rlray export latest --config configs/grpo_gsm8k_tiny.yaml --to exported/grpo",
                  "rlray export outputs/run/snapshots/run-1a2b/step_00000040 --to exported/step40",
                  "rlray export 1a2b3c4d5e6f --config configs/grpo_gsm8k_tiny.yaml --to exported/grpo --adapter"],
                 "docs/export.md", "export")
    x.add_argument("ref", metavar="RUN_OR_SNAPSHOT", help="a snapshot folder or URI, a run folder (its newest complete "
                   "snapshot), 'latest' (newest under checkpoint.uri) or an MLflow run id (its newest snapshot)")
    x.add_argument("--to", required=True, metavar="DIR", help="a new (or empty) folder for the export")
    x.add_argument("--adapter", action="store_true", help="LoRA runs: write the peft adapter folder instead of merging")
    _run_config(x, optional=True)

    m = _command(sub, "models", "lineage in the Model Registry: rlray models list|show", """
        The lineage of a run's snapshots in the MLflow Model Registry (rlray-<experiment>).""",
                 ["rlray models list --config configs/grpo_gsm8k_tiny.yaml"], "docs/operations.md")
    msub = _subcommands(m, "models_command")
    ml = _command(msub, "list", "versions of rlray-<experiment> (of one run with --run)", """
        Lists the registered versions of rlray-<experiment>, or of one run with --run.""",
                  ["rlray models list --config configs/grpo_gsm8k_tiny.yaml",
                   "rlray models list --run 1a2b3c4d5e6f tracking.experiment=grpo-gsm8k"], "docs/operations.md", "models")
    ml.add_argument("--run", metavar="RUN_ID", help="only the versions of this MLflow run")
    ms = _command(msub, "show", "the chain from a version back to the first snapshot", """
        Shows the chain from a version (or a run's newest) back to the first snapshot: each version's step, run
        and parent.""", ["rlray models show v3 --config configs/grpo_gsm8k_tiny.yaml"], "docs/operations.md", "models")
    ms.add_argument("version", metavar="VERSION", help="a version (3 or v3) or an MLflow run id")
    for q in (ml, ms):
        q.add_argument("--experiment", help="experiment name (default: the config's tracking.experiment)")
        _run_config(q, optional=True)

    s = _command(sub, "snapshots", "snapshot storage: rlray snapshots list|lifecycle", """
        The snapshots under checkpoint.uri and their retention.""",
                 ["rlray snapshots list --config configs/grpo_gsm8k_tiny.yaml"], "docs/operations.md")
    ssub = _subcommands(s, "snapshots_command")
    sl = _command(ssub, "list", "every snapshot under checkpoint.uri, complete or not", """
        Lists every snapshot under checkpoint.uri, complete or not, with its step.""",
                  ["rlray snapshots list --config configs/grpo_gsm8k_tiny.yaml",
                   "rlray snapshots list checkpoint.uri=outputs/snapshots"], "docs/operations.md", "snapshots")
    lc = _command(ssub, "lifecycle", "print (and with --apply, set) S3 lifecycle rules", """
        Prints the S3 lifecycle rules that expire snapshots and logs after checkpoint.max_age_days and
        checkpoint.log_max_age_days; with --apply, sets them on the bucket.""",
                  ["rlray snapshots lifecycle checkpoint.uri=s3://bucket/rlray --apply"], "docs/operations.md", "snapshots")
    lc.add_argument("--apply", action="store_true", help="set the rules on the bucket")
    for q in (sl, lc):
        _run_config(q, optional=True)

    c = _command(sub, "config", "print the resolved config, or the reference of every key: rlray config CONFIG", """
        Prints CONFIG resolved (every key, defaults filled in, secrets masked), with --describe each key's meaning
        as a YAML comment. rlray config --reference prints the reference of every key, --metrics-reference of
        every metric (Markdown).""", ["rlray config configs/grpo_gsm8k_tiny.yaml learner.lr=1e-5 --describe",
                                      "rlray config --reference"], "docs/reference/config.md", "config")
    c.add_argument("config", nargs="?", metavar="CONFIG", help=CONFIG_HELP)
    c.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help=OVERRIDES_HELP)
    c.add_argument("--set", dest="set_overrides", action="append", default=[], help=argparse.SUPPRESS)
    c.add_argument("--describe", action="store_true",
                   help="precede each field with its description (unit and scope) and default, as YAML comments")
    c.add_argument("--reference", action="store_true",
                   help="print the config reference instead: every key of every section with its type, default, unit "
                   "and meaning, as Markdown tables (docs/reference/config.md)")
    c.add_argument("--metrics-reference", action="store_true",
                   help="print the metrics reference instead: every metric key a run logs with its unit, meaning and "
                   "where the live page shows it, as Markdown tables (docs/reference/metrics.md)")

    pl = _command(sub, "plan", "memory of every role before any resource is taken: rlray plan CONFIG [--gpus N]", """
        Plans the memory of every role (rollout engines, learner ranks, reference, judges) before any resource is
        taken, and says what to change when it does not fit. model.path may be a folder with only config.json.
        Exit status 1 when it does not fit.""",
                  ["rlray plan configs/grpo_gsm8k_smollm2.yaml model.path=configs/models/qwen2.5-7b --gpus 8 "
                   "--gpu-memory-gib 80"], "docs/distributed.md", "plan")
    _run_config(pl)
    pl.add_argument("--gpus", type=int, metavar="N", help="GPUs per node to plan for (default: what the config asks; a "
                    "config that asks for none gets a layout: half rollout engines, half learner ranks)")
    pl.add_argument("--gpu-memory-gib", type=float, metavar="M", help="memory of one GPU in GiB (default: this "
                    "machine's, nvidia-smi)")
    pl.add_argument("--nodes", type=int, default=1, metavar="K", help="nodes of --gpus GPUs each (default 1)")

    o = _command(sub, "monitor", "serve the live page of a run kept in MLflow: rlray monitor RUN_ID", """
        Serves the live page of a run kept in MLflow, finished or running (read-only), until Ctrl-C.""",
                 ["rlray monitor 1a2b3c4d5e6f --port 8888",
                  "rlray monitor 1a2b3c4d5e6f --tracking-uri sqlite:///mlruns/mlflow.db"], "docs/watching.md", "monitor")
    _run_id(o)
    o.add_argument("--port", type=int, default=0, help="port to serve on (default 0: a free port, printed)")
    o.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the page)")
    o.add_argument("--refresh-s", type=float, default=10.0, help="seconds between rereads of a running run (default 10)")
    _run_config(o, optional=True)

    g = _command(sub, "ledger", "which prompts a run trained on and how often: rlray ledger RUN_ID [--check]", """
        Says which prompts a run trained on and how often, from its prompt ledger in MLflow; with --check, checks it
        against the run's seeded prompt stream (exit status 1 when it differs).""",
                 ["rlray ledger 1a2b3c4d5e6f --check", "rlray ledger 1a2b3c4d5e6f --prompts"], "docs/watching.md", "ledger")
    _run_id(g)
    g.add_argument("--check", action="store_true",
                   help="also check the ledger against the seeded prompt stream of the run's logged config (its data "
                   "files and tokenizer must load here): every prompt of each epoch once, in order; exit 1 when not")
    g.add_argument("--prompts", action="store_true", help="list every prompt: times taken and the steps that took it")
    _run_config(g, optional=True)

    d = _command(sub, "data", "datasets: rlray data fetch NAME [NAME ...] [--dest data]", """
        The data sets rlray's configs and tests use.""", ["rlray data fetch gsm8k"], "docs/quickstart.md")
    f = _command(_subcommands(d, "data_command"), "fetch", "fetch data sets into DEST/NAME", """
        Fetches each named data set into DEST/NAME: gsm8k (train.jsonl, test.jsonl) and hh-rlhf-harmless from the mirror
        (RLRAY_DATA_MIRROR) or the Hugging Face hub; retry-arith and guess-number are generated.""",
                 ["rlray data fetch gsm8k", "rlray data fetch hh-rlhf-harmless --dest data"], "docs/quickstart.md", "data")
    f.add_argument("names", metavar="NAME", nargs="+", choices=["gsm8k", "hh-rlhf-harmless", "retry-arith", "guess-number"],
                   help="gsm8k, hh-rlhf-harmless, retry-arith or guess-number (several: one after another)")
    f.add_argument("--dest", default="data", help="folder to fetch into (default: data)")
    return p
