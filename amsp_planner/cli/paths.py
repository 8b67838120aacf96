"""Path arguments of the commands: click's Path, refusing an empty value in one line (an empty
path would otherwise be read as the current folder, ".")."""

from __future__ import annotations

import click


class Path(click.Path):
    """``click.Path`` that refuses '' (and blanks): "is empty: give a file" (or a folder)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail(f"is empty: give a {'folder' if not self.file_okay else 'file'} name",
                      param, ctx)
        return super().convert(value, param, ctx)
