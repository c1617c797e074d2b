"""Progress on stderr for a long prompt, shared by the verbs that decode one (run, state save)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtool.commands.common.text import real_console

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

PROMPT_CHUNK = 256  # tokens a prompt is decoded by when its progress is shown


class PromptBar:
    """A bar on stderr while a long prompt is decoded (ChatSession.respond's on_prompt); short
    prompts, done in one chunk, show nothing."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._bar: Progress | None = None

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            if done >= total:
                return
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            columns = (TextColumn("prompt"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            self._bar = Progress(*columns, console=real_console(self.console), transient=True)
            self._bar.start()
            self._task = self._bar.add_task("prompt", total=total)
        self._bar.update(self._task, completed=done)
        if done >= total:
            self.close()

    def close(self) -> None:
        """Takes the bar away (also when the decode was interrupted)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
