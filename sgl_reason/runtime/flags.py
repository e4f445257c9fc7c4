"""Runtime flags the plugin adds to SGLang's own launcher.

SGLang parses ``sys.argv`` in the launcher process and spawns the scheduler afterwards, before
which no plugin state reaches it. Each flag is therefore stored on the namespace *and* exported
to an environment variable that the spawned scheduler inherits.
"""

from __future__ import annotations

import argparse
import os


class _ExportToEnv(argparse.Action):
    env: str = ""

    def __call__(self, parser, namespace, value, option_string=None):
        setattr(namespace, self.dest, value)
        os.environ[self.env] = str(value)


def export_to(env: str) -> type[argparse.Action]:
    """An argparse action that also writes the flag's value to ``env``."""
    return type(f"ExportTo_{env}", (_ExportToEnv,), {"env": env})


def has_flag(parser: argparse.ArgumentParser, flag: str) -> bool:
    return any(flag in action.option_strings for action in parser._actions)


def wrap_server_args(tag: str, add_flags, validate, prepare=None) -> None:
    """Chain ``add_flags(parser)`` onto ``ServerArgs.add_cli_args``, and onto
    ``ServerArgs.resolve_once`` (where launchers resolve defaults) ``prepare(args)`` before it
    (the record is still writable: fill in implied flags) and ``validate(args)`` after it (the
    record is sealed: check), once per ``tag``."""
    from sglang.srt import server_args as sa

    cls = sa.ServerArgs
    marker = f"_sgl_reason_{tag}"
    if getattr(cls, marker, False):
        return
    stock_add, stock_resolve = cls.add_cli_args, cls.resolve_once

    def add_cli_args(parser):
        stock_add(parser)
        add_flags(parser)

    def resolve_once(self):
        if prepare is not None and not getattr(self, "_resolution_finished", False):
            prepare(self)
        stock_resolve(self)
        validate(self)

    cls.add_cli_args = staticmethod(add_cli_args)
    cls.resolve_once = resolve_once
    setattr(cls, marker, True)
