"""The ``rlray`` command line as a first-time user meets it (issue 40): every command's ``--help`` says what it does and
shows examples that parse, a bad command line gets ``rlray <command>:`` lines that say what to type (never
argparse's own wording), and overrides are KEY=VALUE arguments everywhere, ``--set`` an older spelling of the same."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from rlray import cli
from rlray.cli_parser import RlrayParser, build_parser

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/grpo_gsm8k_tiny.yaml"
ARGPARSE_WORDING = ("usage:", "error:", "the following arguments are required", "invalid choice", "unrecognized",
                    "expected one argument", "data_command", "judge_command", "models_command", "overrides", "{")


def commands(parser: RlrayParser, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], RlrayParser]]:
    """Returns (command path, parser) of every command and subcommand under ``parser``."""
    out = []
    for name, sub in (parser._subparsers._group_actions[0].choices.items() if parser._subparsers else []):
        out += [((*path, name), sub), *commands(sub, (*path, name))]
    return out


COMMANDS = commands(build_parser())


def test_the_tree_has_every_command():
    assert [" ".join(p) for p, _ in COMMANDS] == [
        "train", "check", "sweep", "eval", "serve-reward", "judge", "judge check", "rollback", "export", "models",
        "models list", "models show", "snapshots", "snapshots list", "snapshots lifecycle", "config", "plan", "monitor",
        "ledger", "data", "data fetch"]
    assert set(cli.HANDLERS) == {p.handler for _, p in COMMANDS if p.handler}  # every leaf has its function
    assert all(p.handler or p._subparsers for _, p in COMMANDS)


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=" ".join)
def test_help_says_what_the_command_does_and_shows_examples_that_parse(path, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([*path, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    about = out.split("\n\n")[1]  # the description, right after the usage
    assert len(about.split()) >= 6 and not about.startswith(("positional", "options")), out
    examples = [x.strip() for x in out.split("examples:\n", 1)[1].split("\n\n")[0].splitlines()]
    assert examples and out.rstrip().splitlines()[-1].startswith("more: docs/")
    assert (REPO / out.rstrip().splitlines()[-1].split()[1].rstrip(",")).is_file()
    for line in examples:
        argv = shlex.split(line)
        assert argv[: 1 + len(path)] == ["rlray", *path], line
        args = build_parser().parse_args(argv[1:])  # exits 2 on a line it does not take
        assert args.handler in cli.HANDLERS
        files = [a for a in argv if a.endswith(".yaml")]
        assert all((REPO / f).is_file() for f in files), f"{line}: names a missing file"


ERRORS = [
    ([], "rlray: give a command: train, check, sweep, eval, serve-reward, judge, rollback, export, models, snapshots, "
         "config, plan, monitor, ledger, data"),
    (["train"], "rlray train: missing CONFIG (the run's config file, as given to rlray train)"),
    (["trian", CONFIG], "rlray: unknown command 'trian'; did you mean 'train'? (command is one of: train, check, sweep, "
                        "eval, serve-reward, judge, rollback, export, models, snapshots, config, plan, monitor, ledger, data)"),
    (["data"], "rlray data: give a command: fetch"),
    (["data", "fetch"], "rlray data fetch: missing NAME (gsm8k, hh-rlhf-harmless, retry-arith or guess-number)"),
    (["data", "fetch", "gsm9k"], "rlray data fetch: unknown NAME 'gsm9k'; did you mean 'gsm8k'? (NAME is one of: gsm8k, "
                                 "hh-rlhf-harmless, retry-arith, guess-number)"),
    (["judge", "check", CONFIG, "--rows", "x"], "rlray judge check: --rows takes a whole number, not 'x'"),
    (["export", "latest"], "rlray export: missing --to DIR (a new (or empty) folder for the export)"),
    (["export", "latest", "--to"], "rlray export: --to DIR (a new (or empty) folder for the export) needs a value after it"),
    (["train", "--config", CONFIG], "rlray train: the config file is this command's first argument, without --config"),
    (["train", CONFIG, "--verbos", "--bogus"], "rlray train: unknown option '--bogus' (did you mean --verbose?)"),
    (["serve-reward", CONFIG, "--detach=1"], "rlray serve-reward: --detach takes no value (drop '=1')"),
    (["models", "list", "stray"], None),  # an optional-config command: 'stray' is a bad override, told by the config
]


@pytest.mark.parametrize(("argv", "first"), ERRORS, ids=[" ".join(a) or "no-command" for a, _ in ERRORS])
def test_a_bad_command_line_gets_rlray_lines_that_say_what_to_type(argv, first, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as done:
        code = done.code
    assert code == 2
    err = capsys.readouterr().err.splitlines()
    assert err and all(x.startswith("rlray") for x in err), err
    assert not [w for w in ARGPARSE_WORDING if w in "\n".join(err)], err
    if first is None:
        assert err[-1] == "rlray: override 'stray' is not of the form dotted.key=value (e.g. learner.lr=1e-5)", err
        return
    assert err[0] == first
    prog = first.split(":")[0]
    example = next(p for path, p in [((), build_parser()), *COMMANDS] if " ".join(("rlray", *path)) == prog).example
    assert err[1] == f"{prog}: for example: {example}; more with {prog} --help"


def test_both_override_forms_give_the_same_config(capsys):
    assert cli.main(["config", CONFIG, "learner.lr=3e-6", "run.seed=5"]) == 0
    plain = capsys.readouterr()
    assert cli.main(["config", CONFIG, "--set", "learner.lr=3e-6", "--set", "run.seed=5"]) == 0
    old = capsys.readouterr()
    assert old.out == plain.out and yaml.safe_load(plain.out)["learner"]["lr"] == 3e-6
    assert plain.err == ""
    assert old.err.splitlines() == ["rlray: --set KEY=VALUE is deprecated; give overrides as plain KEY=VALUE arguments, "
                                    "e.g. rlray config configs/grpo_gsm8k_tiny.yaml learner.lr=1e-5 --describe"]
    # the commands whose config is optional read the same overrides either way, wherever they stand
    p = build_parser()
    one = p.parse_args(["snapshots", "list", "checkpoint.uri=/tmp/s", "--config", CONFIG, "checkpoint.keep_last=2"])
    two = p.parse_args(["snapshots", "list", "--set", "checkpoint.uri=/tmp/s", "--config", CONFIG,
                        "--set", "checkpoint.keep_last=2"])
    assert one.overrides == two.overrides == ["checkpoint.uri=/tmp/s", "checkpoint.keep_last=2"]
    assert cli._optional_config(one) == cli._optional_config(two)
    assert cli._optional_config(one).checkpoint.keep_last == 2
    # KEY=VALUE after an option is an override too, in order
    a = p.parse_args(["train", CONFIG, "learner.lr=1e-5", "--resume", "latest", "run.max_steps=3"])
    assert (a.config, a.overrides, a.resume) == (CONFIG, ["learner.lr=1e-5", "run.max_steps=3"], "latest")


def test_the_troubleshooting_page_shows_what_a_bad_command_line_prints(capsys):
    text = (REPO / "docs" / "troubleshooting.md").read_text()
    marker = "<!-- docs: tested-by tests/test_cli_parser.py::test_the_troubleshooting_page_shows_what_a_bad_command_line_prints -->"
    block = text.split(marker, 1)[1].split("```console\n", 1)[1].split("```", 1)[0]
    shown: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            shown.append((line[2:], []))
        else:
            shown[-1][1].append(line)
    assert len(shown) == 4
    for command, lines in shown:
        with pytest.raises(SystemExit) as done:
            cli.main(shlex.split(command)[1:])
        assert done.value.code == 2
        assert capsys.readouterr().err.splitlines() == lines, command
