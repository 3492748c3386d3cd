"""Plugins add subcommands to ``executor`` through ``executor_register_commands``."""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

import pytest

from executor_core import _cli, hookimpl
from executor_core._cli import IN_TREE_COMMANDS, build_parser
from executor_core.backend import Registry, default_registry


class _HelloPlugin:
    @hookimpl
    def executor_register_commands(self, commands: argparse._SubParsersAction[Any]) -> None:
        hello = commands.add_parser("hello", help="say hello")
        hello.add_argument("--name", default="world")
        hello.set_defaults(func=lambda args: print(f"hello {args.name}") or 7)


def test_a_plugin_command_is_parsed_and_run(capsys: pytest.CaptureFixture[str]) -> None:
    registry = Registry()
    assert registry.register_plugin(_HelloPlugin(), "hello")
    args = build_parser(registry).parse_args(["hello", "--name", "you"])
    assert args.func(args) == 7
    assert capsys.readouterr().out == "hello you\n"


def test_a_clashing_command_stops_with_its_name() -> None:
    class Clash:
        @hookimpl
        def executor_register_commands(self, commands: argparse._SubParsersAction[Any]) -> None:
            commands.add_parser("backends")

    registry = Registry()
    assert registry.register_plugin(Clash(), "clash")
    with pytest.raises(SystemExit, match="clashes"):
        build_parser(registry)


def test_the_mp_plugin_adds_executor_node() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "executor_core", "node", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--master-addr" in done.stdout
    assert "EXECUTOR_NODE_RANK" in done.stdout


def test_the_core_adds_no_command_but_backends() -> None:
    parser = build_parser(Registry())
    assert parser.parse_args(["backends"]).command == "backends"
    for name in IN_TREE_COMMANDS:  # run, node, bench: each from its plugin
        with pytest.raises(SystemExit):
            parser.parse_args([name])


def test_a_missing_in_tree_command_names_its_distribution(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(_cli.IN_TREE_COMMANDS, "fly", "executor-no-such-distribution")
    with pytest.raises(SystemExit) as info:
        _cli.main(["fly", "--high"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown command 'fly'." in err
    assert "provided by executor-no-such-distribution: pip install executor-no-such-" in err
    # Other unknown commands get argparse's own message, with the choices.
    with pytest.raises(SystemExit):
        _cli.main(["flyer"])
    assert "invalid choice: 'flyer'" in capsys.readouterr().err
    _cli.build_parser(default_registry()).print_help()
    assert "  fly: pip install executor-no-such-distribution" in capsys.readouterr().out
